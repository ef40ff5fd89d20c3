-- Times slurm_job_submit per call: lua5.1 bench_filter.lua FILTER SNAPSHOT CALLS NODES
local filter, snapshot, calls, nodes = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4])
gpuwarden_snapshot_path = snapshot
slurm = { SUCCESS = 0, NO_VAL = 4294967294, reservations = {},
          log_info = function() end, log_user = function() end }
dofile(filter)
local function job()
  return { min_nodes = nodes, req_switch = 4294967294, wait4switch = 4294967294, contiguous = 0,
           tres_per_node = "gres/gpu:8", exc_nodes = "n00017" }
end
slurm_job_submit(job(), {}, 1000) -- the first call loads the snapshot
local t0 = os.clock()
for _ = 1, calls do
  slurm_job_submit(job(), {}, 1000)
end
local per_call = (os.clock() - t0) / calls
-- What a new snapshot generation costs, once per change (parse and load of the whole table).
local t1 = os.clock()
local reloads = 20
if gpuwarden_placement then -- the do-nothing baseline filter has no loader
  for _ = 1, reloads do
    assert(gpuwarden_placement.load(snapshot))
  end
end
print(string.format("%.3f %.3f", per_call * 1e6, (os.clock() - t1) / reloads * 1e3))
