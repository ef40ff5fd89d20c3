-- Drives plugins/job_submit.lua outside slurmctld: a stub `slurm` table, jobs as plain tables.
-- Usage: lua5.1 drive.lua FILTER SNAPSHOT CASES   (CASES: a Lua file returning a list of jobs)
-- Prints, per case: "case N" then "field=value" for each field the filter set, then its logs.
local filter, snapshot, cases_file = arg[1], arg[2], arg[3]
gpuwarden_snapshot_path = snapshot
gpuwarden_check_every = 0
local logs = {}
slurm = {
  SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294,
  log_info = function(fmt, ...) table.insert(logs, "info: " .. string.format(fmt, ...)) end,
  log_user = function(fmt, ...) table.insert(logs, "user: " .. string.format(fmt, ...)) end,
}
dofile(filter)
local cases = dofile(cases_file)
local FIELDS = { "req_switch", "wait4switch", "exc_nodes", "admin_comment" }
for i, job in ipairs(cases) do
  logs = {}
  local before = {}
  for _, f in ipairs(FIELDS) do before[f] = job[f] end
  local rc = slurm_job_submit(job, {}, 1000)
  print("case " .. i .. " rc=" .. tostring(rc))
  for _, f in ipairs(FIELDS) do
    if job[f] ~= before[f] then print(f .. "=" .. tostring(job[f])) end
  end
  for _, l in ipairs(logs) do print("log " .. l) end
end
