-- gpuwarden job_submit filter: gang-aware topology placement.
--
-- slurmctld runs this under its locks, one call at a time (Lua 5.1). So it does no subprocess,
-- no network, no Slurm call: it reads a snapshot file that `gpuwarden placement daemon` writes
-- (a Lua table, replaced atomically), at most once every CHECK_EVERY seconds and only when its
-- generation line changed, and looks things up in it.
--
-- For a multi-node GPU job it sets req_switch to the fewest leaf switches that can hold the
-- job and wait4switch from the partition's policy, adds suspect and lemon nodes to exc_nodes
-- (merged with the user's own), and records the decision in admin_comment. What the user asked
-- for explicitly (--switches, --nodelist, --contiguous, --exclude) is kept.
--
-- It never rejects a job: any error, a missing, corrupt or stale snapshot, and the job goes
-- through unchanged, with one log line.
--
-- Install: copy or link as job_submit.lua beside slurm.conf; JobSubmitPlugins=lua.

local SNAPSHOT = gpuwarden_snapshot_path or "/etc/slurm/gpuwarden-placement.lua"
local CHECK_EVERY = gpuwarden_check_every or 2
local NO_VAL = 4294967294
local REQUIRED_WAIT = 604800 -- "required": as long as Slurm's max_switch_wait allows

local cache = { snap = nil, generation = nil, written = 0, checked = nil, err = "not read yet" }

-- The first line: "-- gpuwarden placement snapshot generation G written T". The daemon
-- rewrites the file every few seconds; G changes only when the content does, T every time.
local function read_header(path)
  local f = io.open(path, "r")
  if not f then
    return nil, "missing"
  end
  local head = f:read(256) -- a bounded read: the header is one short line
  f:close()
  local line = head and string.match(head, "^[^\n]*")
  local gen, written
  if line then
    gen, written = string.match(line,
      "^%-%- gpuwarden placement snapshot generation (%d+) written (%d+)$")
  end
  if not gen then
    return nil, "has no generation line (corrupt?)"
  end
  return tonumber(gen), tonumber(written)
end

local MAX_BYTES = 8 * 1024 * 1024
local MAX_STEPS = 50000000 -- VM instructions; a real snapshot needs a tiny fraction

local function evaluate(chunk)
  -- The file is data: no globals (empty environment), no string methods (the shared string
  -- metatable), and a budget of instructions, so that even a hostile file cannot loop or grow
  -- without end inside slurmctld.
  setfenv(chunk, {})
  local co = coroutine.create(chunk)
  debug.sethook(co, function() error("snapshot takes too long to evaluate") end, "", MAX_STEPS)
  local strmeta = getmetatable("")
  local index = strmeta.__index
  strmeta.__index = nil
  local ok, ran, value = pcall(coroutine.resume, co)
  strmeta.__index = index
  if not ok then
    return false, ran
  end
  return ran, value
end

local function load_snapshot(path)
  local f = io.open(path, "r")
  if not f then
    return nil, "missing"
  end
  local size = f:seek("end")
  f:close()
  if not size or size > MAX_BYTES then
    return nil, "too large (" .. tostring(size) .. " bytes)"
  end
  local chunk, err = loadfile(path)
  if not chunk then
    return nil, "cannot parse: " .. tostring(err)
  end
  local ok, snap = evaluate(chunk)
  if not ok then
    return nil, "cannot evaluate: " .. tostring(snap)
  end
  if type(snap) ~= "table" or snap.version ~= 1 or type(snap.partitions) ~= "table"
      or type(snap.stale_after) ~= "number" or type(snap.generation) ~= "number" then
    return nil, "not a version 1 snapshot"
  end
  return snap
end

local function current(now)
  if cache.checked == nil or now - cache.checked >= CHECK_EVERY or now < cache.checked then
    cache.checked = now
    local gen, written = read_header(SNAPSHOT)
    if not gen then
      cache.snap, cache.generation, cache.err = nil, nil, written
    else
      cache.written = written
      if gen ~= cache.generation then
        local snap, err = load_snapshot(SNAPSHOT)
        cache.snap, cache.err = snap, err
        cache.generation = snap and gen or nil
      end
    end
  end
  local snap = cache.snap
  if not snap then
    return nil, cache.err
  end
  local age = now - cache.written
  if age > snap.stale_after then
    return nil, string.format("stale: written %d s ago (is the placement daemon running?)", age)
  end
  return snap
end

local function set(v)
  return type(v) == "number" and v < NO_VAL
end

local GPU_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }

local function wants_gpus(job)
  for _, f in ipairs(GPU_FIELDS) do
    local v = job[f]
    if type(v) == "string" and string.find(v, "gpu", 1, true) then
      return true
    end
  end
  return false
end

-- The same decision as gpuwarden/placement/decide.py (tests run both on the same cases).
local function decide(snap, job)
  local part = job.partition
  if part == nil or part == "" then
    part = snap.default_partition
  else
    part = string.match(part, "^[^,]+")
  end
  local view = snap.partitions[part]
  if not view then
    return { action = "pass", why = "partition " .. tostring(part) .. " is not in the snapshot" }
  end
  if view.mode == "off" then
    return { action = "pass", why = "placement is off for partition " .. part }
  end
  local min_nodes = job.min_nodes
  if not set(min_nodes) then
    min_nodes = 1
  end
  if min_nodes < view.min_nodes or not wants_gpus(job) then
    return { action = "pass", why = "not a gang job" }
  end
  local k, total = nil, 0
  for i, c in ipairs(view.capacity) do
    total = total + c
    if total >= min_nodes then
      k = i
      break
    end
  end
  local d = { notes = {} }
  if k == nil then
    d.message = string.format("gpuwarden: this job asks for %d nodes but partition %s has %d "
      .. "healthy nodes now; it waits for repairs", min_nodes, part, view.healthy)
    table.insert(d.notes, string.format("only %d healthy nodes", view.healthy))
  elseif set(job.req_switch) then
    table.insert(d.notes, string.format("--switches=%d kept", job.req_switch))
  elseif job.req_nodes ~= nil and job.req_nodes ~= "" then
    table.insert(d.notes, "--nodelist kept")
  elseif job.contiguous == 1 then
    table.insert(d.notes, "--contiguous kept")
  elseif snap.kind == "block" then
    table.insert(d.notes, "topology/block: --segment is cli_filter.lua's")
  else
    d.switches = k
    d.wait = view.mode == "required" and REQUIRED_WAIT or view.wait
    table.insert(d.notes, string.format("switches=%d wait=%ds", k, d.wait))
  end
  if view.exclude ~= "" and (job.req_nodes == nil or job.req_nodes == "") and k ~= nil then
    local mine = job.exc_nodes
    if mine ~= nil and mine ~= "" then
      d.exc = mine .. "," .. view.exclude
    else
      d.exc = view.exclude
    end
    table.insert(d.notes, "exclude " .. view.exclude)
  end
  d.why = table.concat(d.notes, "; ")
  if d.switches == nil and d.exc == nil then
    d.action = "pass"
  elseif view.shadow then
    d.action = "shadow"
  else
    d.action = "place"
  end
  return d
end

local FIELDS = { "req_switch", "wait4switch", "exc_nodes", "admin_comment" }

local TEXT = { exc_nodes = true, admin_comment = true }

local function apply(job, d, snap)
  -- Everything that can fail is computed before the first change.
  local note = string.format("gpuwarden placement (snapshot %d): %s", snap.generation, d.why)
  local prev = job.admin_comment
  if prev ~= nil and prev ~= "" then
    note = prev .. "; " .. note
  end
  local before = {}
  for _, f in ipairs(FIELDS) do
    before[f] = job[f]
  end
  local ok, err = pcall(function()
    if d.switches then
      job.req_switch = d.switches
      job.wait4switch = d.wait
    end
    if d.exc then
      job.exc_nodes = d.exc
    end
    job.admin_comment = note
  end)
  if not ok then
    -- All or nothing: put back what was changed before the error (Slurm takes "" for an
    -- unset text field, not nil).
    for _, f in ipairs(FIELDS) do
      local v = before[f]
      if v == nil and TEXT[f] then
        v = ""
      end
      pcall(function() job[f] = v end)
    end
    error(err, 0)
  end
end

function slurm_job_submit(job, part_list, submit_uid)
  local ok, err = pcall(function()
    local snap, why = current(os.time())
    if not snap then
      slurm.log_info("gpuwarden placement: snapshot %s %s; job from uid %s unchanged",
        SNAPSHOT, tostring(why), tostring(submit_uid))
      return
    end
    local d = decide(snap, job)
    if d.message then
      slurm.log_user("%s", d.message)
    end
    if d.action == "pass" then
      return
    end
    if d.action == "shadow" then
      slurm.log_info("gpuwarden placement (shadow): job from uid %s: would set %s",
        tostring(submit_uid), d.why)
      return
    end
    apply(job, d, snap)
    slurm.log_info("gpuwarden placement: job from uid %s: %s", tostring(submit_uid), d.why)
  end)
  if not ok then
    slurm.log_info("gpuwarden placement: error (%s); job from uid %s unchanged",
      tostring(err), tostring(submit_uid))
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

-- For tests and the microbenchmark (never called by slurmctld).
gpuwarden_placement = { decide = decide, current = current, cache = cache, load = load_snapshot }
