-- gpuwarden job_submit filter: gang-aware topology placement.
--
-- slurmctld runs this under its locks, one call at a time (Lua 5.1). So it does no subprocess,
-- no network, no Slurm call: it reads a snapshot file that `gpuwarden placement daemon` writes
-- (replaced atomically), at most once every CHECK_EVERY seconds and only when its generation
-- line changed, and looks things up in it.
--
-- For a multi-node GPU job it sets req_switch to the fewest leaf switches that can hold the
-- job and wait4switch from the partition's policy, adds suspect and lemon nodes to exc_nodes
-- (merged with the user's own) when the job can still run without them, and records the
-- decision in admin_comment. A job held for fewer switches is told so at submit
-- (slurm.log_user), and the same line goes to its comment unless the user set one. What the
-- user asked for explicitly (--switches, --nodelist, --contiguous, --exclude, --reservation,
-- --comment) is kept.
--
-- It never rejects a job: any error, a missing, corrupt, stale or unsafe snapshot, and the job
-- goes through unchanged, with one log line.
--
-- The snapshot is data, never code: it is parsed line by line with anchored patterns, under a
-- byte cap and an item cap, so no file can make slurmctld allocate without bound. It is read
-- only from the directory of the file slurmctld loaded (slurm.conf's, which it already trusts
-- for the code it runs), also when a site's own job_submit.lua dofile()s this one from
-- elsewhere, and with lua-filesystem only if it and that directory are owned by root or by
-- slurmctld's user and writable by no one else; a link, FIFO or device is never opened.
--
-- Install: copy or link as job_submit.lua beside slurm.conf; JobSubmitPlugins=lua.

-- The directory of the file slurmctld loaded: the outermost chunk on the stack with an absolute
-- source ("@/etc/slurm/job_submit.lua"), not this file's own, which a site's wrapper may have
-- dofile()d from /opt. Without one (a test run from stdin), $SLURM_CONF's directory.
local function conf_dir()
  local found, level = nil, 1
  while true do
    local info = debug.getinfo(level, "S")
    if not info then
      break
    end
    found = string.match(info.source or "", "^@(/.*)/[^/]+$") or found
    level = level + 1
  end
  return found or string.match(os.getenv("SLURM_CONF") or "", "^(/.*)/[^/]+$")
end

local HERE = conf_dir()
local SNAPSHOT = gpuwarden_snapshot_path or (HERE and HERE .. "/gpuwarden-placement.lua")
local CHECK_EVERY = gpuwarden_check_every or 2
local LOG_EVERY = gpuwarden_log_every or 300 -- an unchanged state is logged again after this
local NO_VAL = 4294967294
local REQUIRED_WAIT = 604800 -- "required": as long as Slurm's max_switch_wait allows
local MAX_BYTES = 4 * 1024 * 1024 -- snapshot.MAX_BYTES; 10,000 nodes take about 8 KiB
local MAX_ITEMS = 100000 -- partitions + capacity entries + exclusion groups + fit runs
local MAX_FIELD = 64 * 1024 -- decide.MAX_FIELD: a longer user string is not parsed at all
local LIST_CHARS = 200 -- decide.LIST_CHARS: node names shown per list in admin_comment and logs
local FORMAT_LINE = "format 4"

local cache = { snap = nil, generation = nil, written = 0, checked = nil, err = "not read yet",
                warned = false, failed = nil, failed_err = nil, parses = 0 }

-- Only absolute entries of a package search path: "./?.so" would load lfs from slurmctld's
-- working directory, which may be one anyone can write (/var/tmp).
local function absolute_only(paths)
  local keep = {}
  for p in string.gmatch(paths or "", "[^;]+") do
    if string.sub(p, 1, 1) == "/" then
      keep[#keep + 1] = p
    end
  end
  return table.concat(keep, ";")
end

local lfs = nil
if not gpuwarden_no_lfs then
  local path, cpath = package.path, package.cpath
  package.path, package.cpath = absolute_only(path), absolute_only(cpath)
  local ok, mod = pcall(require, "lfs")
  package.path, package.cpath = path, cpath
  lfs = ok and type(mod) == "table" and mod or nil
end

-- Log a state once per change per channel, and again at most every LOG_EVERY s while it lasts:
-- slurmctld's log must not get a line for every job while the daemon is down.
local said = {}
local function say(channel, key, fmt, ...)
  local now, last = os.time(), said[channel]
  if last and last.key == key and now >= last.at and now - last.at < LOG_EVERY then
    return
  end
  said[channel] = { key = key, at = now }
  slurm.log_info(fmt, ...)
end

local function my_uid()
  local f = io.open("/proc/self/status", "r")
  if not f then
    return nil
  end
  local status = f:read(4096) or ""
  f:close()
  return tonumber(string.match(status, "\nUid:%s+%d+%s+(%d+)")) -- the effective uid
end
local MY_UID = my_uid()

local function unsafe_attrs(what, a, kind)
  if not a then
    return what .. " is missing"
  end
  if a.mode ~= kind then
    return string.format("%s is a %s, not a %s", what, tostring(a.mode), kind)
  end
  if a.uid ~= 0 and a.uid ~= MY_UID then
    return string.format("%s is owned by uid %s, not by root or slurmctld's user", what,
      tostring(a.uid))
  end
  local perm = a.permissions or ""
  if string.sub(perm, 5, 5) ~= "-" or string.sub(perm, 8, 8) ~= "-" then
    return string.format("%s is writable by group or others (%s)", what, perm)
  end
  return nil
end

-- Why the snapshot at `path` must not be trusted, or nil.
local function path_problem(path)
  if not path then
    return "cannot be found: job_submit.lua was not loaded from an absolute path, and "
      .. "SLURM_CONF is not set"
  end
  local dir = string.match(path, "^(/.*)/[^/]+$")
  if dir == nil or dir ~= HERE then
    return "is not beside job_submit.lua (" .. tostring(HERE) .. "); refused"
  end
  if not lfs then
    return nil
  end
  local problem = unsafe_attrs("its directory", lfs.attributes(dir), "directory")
  if problem then
    return problem
  end
  local a = lfs.symlinkattributes(path) -- lstat: a link or FIFO is refused, never opened
  if not a then
    return "missing"
  end
  return unsafe_attrs("the file", a, "file")
end

-- The first line: "-- gpuwarden placement snapshot generation G written T". The daemon
-- rewrites the file every few seconds; G changes only when the content does, T every time.
local HEADER = "^%-%- gpuwarden placement snapshot generation (%d+) written (%d+)\n"

local function read_header(path)
  local f = io.open(path, "r")
  if not f then
    return nil, "missing"
  end
  local head = f:read(256) -- a bounded read: the header is one short line
  f:close()
  local gen, written = string.match(head or "", HEADER)
  if not gen then
    return nil, "has no generation line (corrupt?)"
  end
  return tonumber(gen), tonumber(written)
end

local MODES = { required = true, preferred = true, off = true }
local NAMES = "^[%w_.@+%-]+$" -- a node or partition name as the daemon writes it

-- "8:6,0:2" (GPUs per node:nodes), most GPUs first, as a list of pairs; nil when malformed.
local function parse_gpus(text, budget)
  local gpus = {}
  for g, n in string.gmatch(text, "(%d+):(%d+)") do
    if #gpus >= budget then
      return nil
    end
    gpus[#gpus + 1] = { gpus = tonumber(g), nodes = tonumber(n) }
  end
  local back = {}
  for i, e in ipairs(gpus) do
    back[i] = e.gpus .. ":" .. e.nodes
  end
  if table.concat(back, ",") ~= text then
    return nil
  end
  return gpus
end

local function parse_partition(line, snap, budget)
  local name, mode, wait, min_nodes, shadow, size, in_service, healthy, gpus, cap =
    string.match(line, "^partition (%S+) mode=(%a+) wait=(%d+) min_nodes=(%d+) shadow=([01]) "
      .. "size=(%d+) in_service=(%d+) healthy=(%d+) gpus=([%d:,]*) capacity=([%d,]*)$")
  if not name or not MODES[mode] or not string.match(name, NAMES) or snap.partitions[name] then
    return nil, "not a valid partition line"
  end
  local capacity = {}
  for c in string.gmatch(cap, "%d+") do
    if #capacity >= budget then
      return nil, string.format("more than %d items", MAX_ITEMS)
    end
    capacity[#capacity + 1] = tonumber(c)
  end
  if table.concat(capacity, ",") ~= cap then
    return nil, "capacity is not a list of numbers"
  end
  local per_node = parse_gpus(gpus, budget - #capacity)
  if not per_node then
    return nil, "gpus is not a list of GPUs:nodes pairs (or has too many items)"
  end
  snap.partitions[name] = { name = name, mode = mode, wait = tonumber(wait),
    min_nodes = tonumber(min_nodes), shadow = shadow == "1", size = tonumber(size),
    in_service = tonumber(in_service), healthy = tonumber(healthy), gpus = per_node,
    capacity = capacity, avoid = {} }
  return 1 + #capacity + #per_node
end

local function parse_avoid(line, snap)
  local part, keep, nodes = string.match(line, "^avoid (%S+) keep=(%d+) nodes=(%S+)$")
  local view = part and snap.partitions[part]
  if not view or string.find(nodes, "[^%w_.@+%-,]") or string.find(nodes, ",,")
      or string.find(nodes, "^,") or string.find(nodes, ",$") then
    return nil, "not a valid avoid line (after its partition)"
  end
  local _, commas = string.gsub(nodes, ",", ",")
  view.avoid[#view.avoid + 1] = { keep = tonumber(keep), nodes = nodes, count = commas + 1 }
  return 1
end

-- "fit gpu 1:0 3:1767225650 9:-1": from N nodes on, when the running jobs' time limits free
-- them under the fewest leaf switches (0 now, -1 not within wait), N ascending (decide.fit_at).
-- Only what the daemon writes is accepted; two flat arrays of numbers, one anchored step a run.
local FIT_BAD = "not a valid fit line (after its preferred partition: ascending N:time runs)"
local function parse_fit(line, snap, budget)
  local part, runs = string.match(line, "^fit (%S+) (.+)$")
  local view = part and snap.partitions[part]
  if not view or view.fit_n or view.mode ~= "preferred" then
    return nil, FIT_BAD
  end
  local ns, ats, pos = {}, {}, 1
  while true do
    if #ns >= budget then
      return nil, string.format("more than %d items", MAX_ITEMS)
    end
    local _, e, n, at, sep = string.find(runs, "^([1-9]%d*):(%-?%d+)( ?)", pos)
    if not e or #n > 9 or #at > 12 then
      return nil, FIT_BAD
    end
    local nn, aa = tonumber(n), tonumber(at)
    if nn > view.healthy or (#ns > 0 and (nn <= ns[#ns] or aa == ats[#ats]))
        or not (at == "0" or at == "-1" or string.find(at, "^[1-9]")) then
      return nil, FIT_BAD
    end
    ns[#ns + 1], ats[#ats + 1] = nn, aa
    pos = e + 1
    if sep == "" then
      break
    end
  end
  if pos <= #runs or ns[1] ~= 1 then
    return nil, FIT_BAD
  end
  view.fit_n, view.fit_at = ns, ats
  return #ns
end

-- One record a line after the two comment lines; "end" last. Nothing is executed, only
-- anchored patterns (linear in the line) run, and what is kept is capped by MAX_ITEMS.
local function parse(data)
  local gen, written = string.match(data, HEADER)
  if not gen then
    return nil, "has no generation line (corrupt?)"
  end
  if string.sub(data, -5) ~= "\nend\n" then
    return nil, "cannot parse: incomplete (no end line)"
  end
  local snap = { generation = tonumber(gen), written = tonumber(written), partitions = {} }
  local items, lineno = 0, 0
  for line in string.gmatch(data, "([^\n]*)\n") do
    lineno = lineno + 1
    local n, err = 0, nil
    if lineno <= 2 then
      n = string.match(line, "^%-%- ") and 0 or nil
      err = "not a comment line"
    elseif lineno == 3 then
      n = line == FORMAT_LINE and 0 or nil
      err = "not a " .. FORMAT_LINE .. " snapshot (from another gpuwarden version?)"
    elseif string.sub(line, 1, 10) == "partition " then
      n, err = parse_partition(line, snap, MAX_ITEMS - items)
    elseif string.sub(line, 1, 6) == "avoid " then
      n, err = parse_avoid(line, snap)
    elseif string.sub(line, 1, 4) == "fit " then
      n, err = parse_fit(line, snap, MAX_ITEMS - items)
    elseif string.match(line, "^why [%w_.@+%-]+ ") then
      n = 0 -- for people and `explain`; the filter needs none of it
    elseif string.match(line, "^stale_after %d+$") then
      snap.stale_after = tonumber(string.sub(line, 13))
    elseif string.match(line, "^kind %a+$") then
      snap.kind = string.sub(line, 6)
    elseif string.match(line, "^default_partition [%w_.@+%-]+$") then
      snap.default_partition = string.sub(line, 19)
      if snap.default_partition == "-" then
        snap.default_partition = ""
      end
    elseif line == "end" then
      n = 0
    else
      n, err = nil, "not a snapshot record"
    end
    if not n then
      return nil, string.format("cannot parse: line %d: %s", lineno, err)
    end
    items = items + n
    if items > MAX_ITEMS then
      return nil, string.format("cannot parse: more than %d items", MAX_ITEMS)
    end
  end
  if not snap.stale_after or not snap.kind or not snap.default_partition then
    return nil, "cannot parse: stale_after, kind or default_partition is missing"
  end
  return snap
end

-- The snapshot, or nil, why, and whether it was refused for where it is (not its content).
local function load_snapshot(path)
  local problem = path_problem(path)
  if problem then
    return nil, problem, true
  end
  cache.parses = cache.parses + 1
  local f = io.open(path, "r")
  if not f then
    return nil, "missing"
  end
  local data = f:read(MAX_BYTES + 1) or "" -- never more than the cap, whatever the file does
  f:close()
  if #data > MAX_BYTES then
    return nil, string.format("too large (over %d bytes)", MAX_BYTES)
  end
  return parse(data)
end

local function unverified_note()
  if lfs or cache.warned then
    return
  end
  cache.warned = true
  slurm.log_info("gpuwarden placement: lua-filesystem is not installed, so the owner and mode "
    .. "of %s are not checked here (only that it is beside job_submit.lua); the daemon "
    .. "checks them when it writes. Install lua-filesystem for Lua 5.1 to check both.",
    tostring(SNAPSHOT))
end

-- Re-read the header; reload only a new generation, and never again one that failed to parse
-- (a corrupt 4 MiB file would otherwise be parsed in full every CHECK_EVERY s).
local function refresh(now)
  cache.checked = now
  local problem = path_problem(SNAPSHOT)
  local gen, written = nil, problem
  if not problem then
    gen, written = read_header(SNAPSHOT)
  end
  if not gen then
    cache.snap, cache.generation, cache.err = nil, nil, written
    return
  end
  cache.written = written
  if cache.snap and gen == cache.generation then
    return
  end
  if gen == cache.failed then
    cache.snap, cache.err = nil, cache.failed_err
    return
  end
  unverified_note()
  local snap, err, refused = load_snapshot(SNAPSHOT)
  cache.snap, cache.err = snap, err
  cache.generation = snap and snap.generation or nil
  cache.written = snap and snap.written or written
  if not snap and not refused then
    cache.failed, cache.failed_err = gen, err
  end
end

local function current(now)
  if cache.checked == nil or now - cache.checked >= CHECK_EVERY or now < cache.checked then
    refresh(now)
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

-- GPUs a tres string asks for ("gres/gpu:8", "gres/gpu:h100:8,license/x:1"): 0 for none, nil
-- when a gpu entry's count cannot be read.
local function gpu_count(v)
  if type(v) ~= "string" then
    return 0
  end
  local total = 0
  for entry in string.gmatch(v, "[^,]+") do
    if string.match(entry, "^gres/gpu[:=]") or entry == "gres/gpu" then
      local n = string.match(entry, "[:=](%d+)$")
      if n then
        total = total + tonumber(n)
      elseif string.match(entry, "^gres/gpu:[%a_][%w_.%-]*$") or entry == "gres/gpu" then
        total = total + 1 -- a type and no count: one
      else
        return nil
      end
    end
  end
  return total
end

-- Every string field the filter parses or copies. Longer than MAX_FIELD, the job is left alone
-- unparsed: walking a 16 MB --exclude would hold slurmctld's locks for seconds.
local USER_FIELDS = { "exc_nodes", "req_nodes", "partition", "reservation", "admin_comment",
  "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }

local function long_field(job)
  for _, f in ipairs(USER_FIELDS) do
    local v = job[f]
    if type(v) == "string" and #v > MAX_FIELD then
      return f
    end
  end
  return nil
end

-- How many nodes a bracket's ranges ("1-4,7") name, or nil.
local function range_width(inner)
  local width = 0
  for part in string.gmatch(inner .. ",", "([^,]*),") do
    local lo, hi = string.match(part, "^(%d+)%-(%d+)$")
    if lo then
      if #lo > 9 or #hi > 9 or tonumber(hi) < tonumber(lo) then
        return nil
      end
      width = width + tonumber(hi) - tonumber(lo) + 1
    elseif string.match(part, "^%d+$") and #part <= 9 then
      width = width + 1
    else
      return nil
    end
  end
  return width
end

-- How many names a hostlist ("c[1-4,7] d5") names at most, or nil when it cannot tell. As
-- Slurm's hostlist.c: names are separated by runs of tab, comma, space and newline outside
-- brackets. Mirrors decide.py's count_names; duplicates count, which only makes the check
-- stricter. Each step is one C-level find, never a Lua loop per character.
local function count_names(expr)
  local total, pos = 0, 1
  while true do
    local s = string.find(expr, "[^\t\n ,]", pos)
    if not s then
      return total
    end
    local count = 1
    pos = s
    while true do
      local _, e = string.find(expr, "^[^\t\n ,%[%]]*", pos)
      pos = e + 1
      local c = string.sub(expr, pos, pos)
      if c == "]" then
        return nil
      elseif c ~= "[" then
        break -- a separator or the end: this name is done
      end
      local close = string.find(expr, "]", pos, true)
      if not close then
        return nil
      end
      local width = range_width(string.sub(expr, pos + 1, close - 1))
      if not width then
        return nil
      end
      count = count * width
      pos = close + 1
    end
    total = total + count
  end
end

-- The most nodes the job could be given (decide.most_nodes): -N a-b may get b; without a
-- maximum, every GPU or task of the job could be on a node of its own. nil: cannot tell.
local function most_nodes(job, min_nodes)
  if set(job.max_nodes) then
    return math.max(min_nodes, job.max_nodes)
  end
  local most = min_nodes
  local per_job, per_node = gpu_count(job.tres_per_job), gpu_count(job.tres_per_node)
  if per_job == nil or per_node == nil then
    return nil
  end
  if per_job > 0 then
    most = math.max(most, per_node > 0 and math.ceil(per_job / per_node) or per_job)
  end
  if set(job.num_tasks) then
    most = math.max(most, job.num_tasks)
  end
  return most
end

-- A node list for admin_comment and the log, at most about LIST_CHARS long (decide.brief):
-- 5,000 suspects must not put 75 KB into every gang job's record.
local function brief(joined, total)
  if #joined <= LIST_CHARS then
    return joined
  end
  local head = string.match(string.sub(joined, 1, LIST_CHARS + 1), "^(.*),")
  if not head then
    return string.format("%d nodes", total)
  end
  local _, commas = string.gsub(head, ",", ",")
  return string.format("%d nodes: %s,... (%d more)", total, head, total - commas - 1)
end

-- Nodes the job cannot use because a reservation it is not in holds them (it names none: a
-- job with --reservation is left alone), counted as if all were of the suspects' kind; nil
-- and why when that cannot be told. A reservation that has not ended counts, future ones
-- too: the job may have to wait for it. slurmctld refreshes slurm.reservations per call.
local function reserved_nodes(now)
  local all = slurm.reservations
  if type(all) ~= "table" then
    return nil, "reservations not visible"
  end
  local total = 0
  for name, r in pairs(all) do
    local ends, nodes = r.end_time, r.node_list
    if not (type(ends) == "number" and ends <= now) and type(nodes) == "string" then
      local n = #nodes <= MAX_FIELD and count_names(nodes) or nil
      if n == nil then
        return nil, "nodes of reservation " .. tostring(name) .. " not understood"
      end
      total = total + n
    end
  end
  return total
end

-- The merged exc_nodes, or nil: never a set that could leave the job unrunnable. A group of
-- suspects (one node kind) is excluded only if that kind keeps enough nodes for the most the
-- job could need even with every node the user excluded and every reserved node taken from it.
local function exclusions(view, job, need, notes)
  if job.partition ~= nil and string.find(job.partition, ",", 1, true) then
    table.insert(notes, "several partitions: suspects not excluded")
    return nil
  end
  if need == nil then
    table.insert(notes, "node count not understood: suspects not excluded")
    return nil
  end
  local user = job.exc_nodes
  if user == nil then
    user = ""
  end
  local mine = count_names(user)
  if mine == nil then
    table.insert(notes, "--exclude not understood: suspects not excluded")
    return nil
  end
  local reserved, why = reserved_nodes(os.time())
  if reserved == nil then
    table.insert(notes, why .. ": suspects not excluded")
    return nil
  end
  local take, kept, ntake, nkept = {}, {}, 0, 0
  for _, g in ipairs(view.avoid) do
    if g.keep - mine - reserved >= need then
      take[#take + 1], ntake = g.nodes, ntake + g.count
    else
      kept[#kept + 1], nkept = g.nodes, nkept + g.count
    end
  end
  if #kept > 0 then
    table.insert(notes, "not excluded " .. brief(table.concat(kept, ","), nkept)
      .. ": too few nodes like them")
  end
  if #take == 0 then
    return nil
  end
  local ours = #take == 1 and take[1] or table.concat(take, ",")
  table.insert(notes, "exclude " .. brief(ours, ntake))
  if user ~= "" then
    return user .. "," .. ours
  end
  return ours
end

-- What the user is told at submit when the job is held for fewer switches, and the comment to
-- set (squeue -O comment, scontrol show job): the same line, unless the user set a comment of
-- their own, which is kept (decide.waits). Slurm's max_switch_wait may cut any wait shorter.
local function waits(job, nodes, switches, wait)
  local leaves = switches == 1 and "one leaf switch" or (switches .. " leaf switches")
  local most = wait == REQUIRED_WAIT and "as long as the cluster's max_switch_wait allows"
    or string.format("up to %d s", wait)
  local line = string.format("gpuwarden: this job may wait %s for %d nodes under %s (fewer "
    .. "network hops), then runs wherever it fits; to start anywhere at once, submit with "
    .. "--switches=%d", most, nodes, leaves, nodes)
  if job.comment ~= nil and job.comment ~= "" then
    return line .. " (your --comment is kept; the decision is in AdminComment: scontrol show "
      .. "job)", nil
  end
  return line, line
end

-- decide.SCHED_MARGIN_S: Slurm starts a waiting job at its next scheduling pass.
local SCHED_MARGIN = 30

-- The fit time for a job of `nodes` nodes (decide.fit_at): binary search of the runs.
local function fit_at(view, nodes)
  local ns, lo, hi, found = view.fit_n, 1, #view.fit_n, nil
  while lo <= hi do
    local mid = math.floor((lo + hi) / 2)
    if ns[mid] <= nodes then
      found, lo = view.fit_at[mid], mid + 1
    else
      hi = mid - 1
    end
  end
  return found
end

-- A job whose wait clock starts later than its submission (Slurm starts it when it first
-- looks at the job): --begin in the future, a dependency, or held (-H: priority 0).
local function deferred(job, now)
  return (set(job.begin_time) and job.begin_time > now)
    or (job.dependency ~= nil and job.dependency ~= "") or job.priority == 0
end

-- How long a "preferred" job waits, and why when the time limits decided it (decide.wait_for).
local function wait_for(view, job, nodes, now)
  if not view.fit_n or deferred(job, now) then
    return view.wait, nil
  end
  local at = fit_at(view, nodes)
  if at == nil or at == 0 then
    return view.wait, nil
  end
  if at == -1 then
    return 0, string.format("not within %ds by the running jobs' time limits", view.wait)
  end
  return math.min(view.wait, math.max(0, at - now) + SCHED_MARGIN),
    "by the running jobs' time limits"
end

local function fewest_leaves(capacity, nodes)
  local total = 0
  for i, c in ipairs(capacity) do
    total = total + c
    if total >= nodes then
      return i
    end
  end
  return nil
end

-- Nodes of the partition, any state, with the GPUs per node the job asks for (decide.usable).
local function usable(view, per_node)
  if per_node == 0 or #view.gpus == 0 then
    return view.size
  end
  local n = 0
  for _, e in ipairs(view.gpus) do
    if e.gpus >= per_node then
      n = n + e.nodes
    end
  end
  return n
end

-- What Slurm refuses at submission, whatever the nodes' state (decide.refused): more nodes
-- than the partition has in all, or than it has with that many GPUs per node; nil when
-- neither or when that cannot be told. Only the minimum counts: Slurm trims -N a-b's maximum.
local function refused(view, want, per_node)
  local most = view.gpus[1] and view.gpus[1].gpus
  if per_node > 0 and most and per_node > most then
    return string.format("asks for %d GPUs per node but no node of partition %s has more than "
      .. "%d: Slurm refuses it; ask for at most %d (--gpus-per-node)", per_node, view.name,
      most, most)
  end
  if want > view.size then
    return string.format("asks for %d nodes but partition %s has %d in all: Slurm refuses it; "
      .. "ask for at most %d (-N), or name a larger partition (-p)", want, view.name,
      view.size, view.size)
  end
  local able = usable(view, per_node)
  if want > able then
    return string.format("asks for %d nodes with %d GPUs each but partition %s has %d such "
      .. "nodes in all: Slurm refuses it; ask for at most %d (-N), or for fewer GPUs per node",
      want, per_node, view.name, able, able)
  end
  return nil
end

-- What the user is told when the job needs more than the healthy nodes (decide.too_few): only
-- what Slurm will do. Fewer in service than its minimum, it waits for nodes to come back;
-- enough, it may start now on suspect nodes. An --exclude that may leave too few: nothing.
local function too_few(view, job, want, nodes, per_node)
  local mine = count_names(job.exc_nodes or "")
  if mine == nil or usable(view, per_node) - mine < want then
    return nil
  end
  if view.in_service < want then
    return string.format("gpuwarden: this job asks for %d nodes and partition %s has %d in "
      .. "service now (%d drained or down): it waits until enough are back", want, view.name,
      view.in_service, view.size - view.in_service)
  end
  local line = string.format("gpuwarden: this job asks for %d nodes but partition %s has %d "
    .. "healthy now: it may start on nodes gpuwarden suspects", nodes, view.name, view.healthy)
  -- Advice names a change: never the -N the job already has, never "at most 0".
  if view.healthy == 0 then
    return line
  end
  if view.healthy < want then
    return line .. string.format("; ask for at most %d (-N) to keep off them", view.healthy)
  end
  return line .. string.format("; its --gpus, -n or -N maximum make it %d: ask for at most %d "
    .. "nodes' worth to keep off them", nodes, view.healthy)
end

-- The same decision as gpuwarden/placement/decide.py (tests run both on the same cases).
local function decide(snap, job)
  local part = job.partition
  if part == nil or part == "" then
    part = snap.default_partition
  else
    part = string.match(part, "^[^,]*")
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
  if job.reservation ~= nil and job.reservation ~= "" then
    -- Its nodes are the reservation's: an exclusion could leave too few of them for good.
    return { action = "pass", why = "--reservation kept" }
  end
  -- Several partitions: Slurm may run it in another, so the user is told nothing.
  local several = job.partition ~= nil and string.find(job.partition, ",", 1, true) ~= nil
  local per_node = gpu_count(job.tres_per_node) or 0
  local larger = refused(view, min_nodes, per_node)
  if larger then
    return { action = "pass", why = "Slurm refuses it in partition " .. part,
      message = not several and "gpuwarden: this job " .. larger or nil }
  end
  local need = most_nodes(job, min_nodes)
  -- -N a-b: Slurm picks the count when it starts the job, so no switch count fits it.
  local elastic = set(job.max_nodes) and job.max_nodes > min_nodes
  local nodes = (elastic or need == nil) and min_nodes or need
  local k = nil
  if nodes <= view.healthy then
    k = fewest_leaves(view.capacity, nodes)
  end
  local d = { notes = {} }
  if k == nil then
    if not several then
      d.message = too_few(view, job, min_nodes, nodes, per_node)
    end
    table.insert(d.notes, string.format("only %d healthy nodes", view.healthy))
  elseif set(job.req_switch) then
    table.insert(d.notes, string.format("--switches=%d kept", job.req_switch))
  elseif job.req_nodes ~= nil and job.req_nodes ~= "" then
    table.insert(d.notes, "--nodelist kept")
  elseif job.contiguous == 1 then
    table.insert(d.notes, "--contiguous kept")
  elseif elastic then
    table.insert(d.notes, "-N min-max: switches left to Slurm")
  elseif need == nil then
    table.insert(d.notes, "node count not understood: switches left to Slurm")
  elseif snap.kind == "block" then
    table.insert(d.notes, "topology/block: --segment is cli_filter.lua's")
  elseif view.mode == "required" then
    d.switches, d.wait = k, REQUIRED_WAIT
    table.insert(d.notes, string.format("switches=%d wait=%ds", k, d.wait))
  else
    local by
    d.wait, by = wait_for(view, job, nodes, os.time())
    d.switches = k
    table.insert(d.notes, string.format("switches=%d wait=%ds", k, d.wait)
      .. (by and " (" .. by .. ")" or ""))
  end
  if #view.avoid > 0 and (job.req_nodes == nil or job.req_nodes == "") and k ~= nil then
    d.exc = exclusions(view, job, need, d.notes)
  end
  d.why = table.concat(d.notes, "; ")
  if d.switches == nil and d.exc == nil then
    d.action = "pass"
  elseif view.shadow then
    d.action = "shadow"
  else
    d.action = "place"
  end
  -- Nothing is promised where any placement meets the switches set (decide.decide).
  if d.action == "place" and d.switches and d.wait > 0 and d.switches < nodes then
    d.message, d.comment = waits(job, nodes, d.switches, d.wait)
  end
  return d
end

local FIELDS = { "req_switch", "wait4switch", "exc_nodes", "admin_comment", "comment" }

local TEXT = { exc_nodes = true, admin_comment = true, comment = true }

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
    if d.comment then
      job.comment = d.comment
    end
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

-- Could this be a gang job (several nodes, GPUs) of any partition? Policies need at least 2
-- nodes (config.py), so every other job passes before the snapshot is even looked at.
local function maybe_gang(job)
  return set(job.min_nodes) and job.min_nodes >= 2 and wants_gpus(job)
end

function slurm_job_submit(job, part_list, submit_uid)
  local ok, err = pcall(function()
    local long = long_field(job)
    if long then
      say("field", long, "gpuwarden placement: job from uid %s: its %s is over %d bytes: left "
        .. "alone unparsed (logged once per %d s)", tostring(submit_uid), long, MAX_FIELD,
        LOG_EVERY)
      return
    end
    if not maybe_gang(job) then
      return
    end
    local snap, why = current(os.time())
    if not snap then
      say("snapshot", string.gsub(tostring(why), "%d+", "N"),
        "gpuwarden placement: snapshot %s %s; job from uid %s unchanged", SNAPSHOT,
        tostring(why), tostring(submit_uid))
      return
    end
    local last = said["snapshot"]
    if last and last.key ~= "in use" then
      say("snapshot", "in use", "gpuwarden placement: snapshot %s in use again (generation %d)",
        SNAPSHOT, snap.generation)
    end
    local d = decide(snap, job)
    if d.action == "shadow" then
      slurm.log_info("gpuwarden placement (shadow): job from uid %s: would set %s",
        tostring(submit_uid), d.why)
    elseif d.action == "place" then
      apply(job, d, snap)
      slurm.log_info("gpuwarden placement: job from uid %s: %s", tostring(submit_uid), d.why)
    end
    -- Only once the job carries what it says (apply is all or nothing).
    if d.message then
      slurm.log_user("%s", d.message)
    end
  end)
  if not ok then
    say("error", string.gsub(tostring(err), "%d+", "N"),
      "gpuwarden placement: error (%s); job from uid %s unchanged", tostring(err),
      tostring(submit_uid))
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

-- For tests and the microbenchmark (never called by slurmctld).
gpuwarden_placement = { decide = decide, current = current, cache = cache, load = load_snapshot,
  count_names = count_names, here = HERE, lfs = lfs }
