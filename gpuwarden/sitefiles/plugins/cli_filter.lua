-- gpuwarden cli_filter: --segment for multi-node GPU jobs on topology/block.
--
-- On Slurm 24.11 job_submit.lua cannot set the segment size, so this runs client side, in
-- sbatch/salloc/srun (Lua 5.1, like job_submit). For a GPU job of more nodes than a block holds
-- that gives no --segment, it sets --segment to the largest divisor of N that fits in the
-- smallest block size of topology.conf (BlockSizes=, or the node count of the first block), so
-- the job is cut into block-sized pieces instead of being scattered. A segment is a hard
-- constraint (no wait-and-fall-back as with --switches): jobs that fit in one block are left
-- to Slurm. With topology/tree (no BlockName lines) it does nothing.
--
-- It never fails a submission: any error leaves the options as they were.
--
-- Install: copy or link as cli_filter.lua beside slurm.conf; CliFilterPlugins=lua.

local TOPOLOGY = gpuwarden_topology_path or "/etc/slurm/topology.conf"

local block_size = nil -- read once per command: sbatch is a short-lived process

local function read_block_size(path)
  local f = io.open(path, "r")
  if not f then
    return 0
  end
  local sizes, first = nil, nil
  for line in f:lines() do
    line = string.gsub(line, "#.*", "")
    local s = string.match(line, "BlockSizes=([%d,]+)")
    if s and not sizes then
      sizes = tonumber(string.match(s, "^(%d+)"))
    end
    local nodes = string.match(line, "BlockName=%S+%s+Nodes=(%S+)")
    if nodes and not first then
      -- "n[01-18]" or "n1,n2": count the names.
      local count = 0
      for part in string.gmatch(nodes, "[^,%[%]]+") do
        local a, b = string.match(part, "^(%d+)%-(%d+)$")
        if a then
          count = count + tonumber(b) - tonumber(a) + 1
        elseif string.match(part, "%d$") then
          count = count + 1
        end
      end
      first = count
    end
  end
  f:close()
  return sizes or first or 0
end

local function wants_gpus(options)
  for _, k in ipairs({ "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket", "gres" }) do
    local v = options[k]
    if v ~= nil and v ~= "" and (k ~= "gres" or string.find(v, "gpu", 1, true)) then
      return true
    end
  end
  return false
end

local function segment_for(nodes, size)
  for d = math.min(nodes, size), 1, -1 do
    if nodes % d == 0 then
      return d
    end
  end
  return 1
end

function slurm_cli_pre_submit(options, offset)
  local ok, err = pcall(function()
    local given = options["segment"]
    -- Slurm reports an unset --segment as "unset".
    if given ~= nil and given ~= "" and given ~= "unset" and given ~= "0" then
      return -- the user's own
    end
    local nodes = tonumber(string.match(tostring(options["nodes"] or ""), "^(%d+)$"))
    if not nodes or nodes < 2 or not wants_gpus(options) then
      return
    end
    if block_size == nil then
      block_size = read_block_size(TOPOLOGY)
    end
    if block_size < 2 or nodes <= block_size then
      -- Not topology/block; or the job fits in one block, where Slurm's block plugin already
      -- prefers one block, and a segment of N would forbid any other placement.
      return
    end
    options["segment"] = tostring(segment_for(nodes, block_size))
  end)
  if not ok then
    slurm.log_debug("gpuwarden cli_filter: %s; options unchanged", tostring(err))
  end
  return slurm.SUCCESS
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
