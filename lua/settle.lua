-- settle.lua: finish an acquisition with its actual cost: refund the unused part or charge
-- the extra to every limit it took from, and release its concurrency units.
--
-- KEYS         the same state keys, in the same order, as the acquisition, then its lease
--              record written by acquire.lua
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      acquisition   id (the concurrency holder)
-- ARGV[3]      n             number of limits
-- ARGV[4..]    5 per limit:  code, count, period_us, burst (acquire.lua's numbers, here as
--              text), then the actual cost for this limit ('' = as reserved: a plain
--              release)
-- ARGV[4+5n]   channel       optional: where to announce capacity given back (a refund,
--                            a concurrency unit released): PUBLISH channel, the names of
--                            the limits that gave some back, space-separated
-- ARGV[5+5n..] 1 per limit:  its name (for the announcement)
-- ARGV[5+6n]   unless_found  '1': settle nothing (status 1) if an acquire under the same
--                            id found the record since it was made (acquire.lua): the
--                            give-back of a cancelled acquire, whose retry took it over
--
-- Returns 'status' then, when settled, one delta per limit
--   status 0 = settled: delta = actual - reserved, > 0 charged, < 0 refunded;
--          1 = already settled, 2 = unknown or expired lease: nothing changed;
--          3 = the keys differ from those recorded: nothing changed.
-- A refund never raises a bucket above its capacity nor moves a GCRA slot before now; a
-- window refund returns cost only to the window that paid, while it still counts.

local now = clock_us(ARGV[1])
local n = tonumber(ARGV[3])
local lease = KEYS[#KEYS]
local rec = redis.call('HMGET', lease, 's', 'n')
if rec[1] == false then
  return '2'
elseif rec[1] ~= '1' then
  return '1'
end
if tonumber(rec[2]) ~= n then
  return '3'
end
if ARGV[5 + 6 * n] == '1' and redis.call('HEXISTS', lease, 'f') == 1 then
  return '1'
end

local fields = {}
for i = 1, n do
  fields[#fields + 1] = 'k' .. i
  fields[#fields + 1] = 'm' .. i
  fields[#fields + 1] = 'c' .. i
end
local marks = redis.call('HMGET', lease, unpack(fields))

local limits = {}
local k = 1
for i = 1, n do
  if marks[3 * i - 2] ~= KEYS[k] then
    return '3'
  end
  local l = limit_record(i, k)
  l.mark = marks[3 * i - 1]
  -- l.cost is the actual cost here (nil: as reserved); delta = actual - reserved.
  l.delta = 0
  if l.cost then
    l.delta = l.cost - tonumber(marks[3 * i])
  end
  limits[i] = l
  k = k + l.algo.nkeys
end

local reply = '0'
local given = nil
for i = 1, n do
  local l = limits[i]
  if l.delta ~= 0 or l.code == 'conc' then
    l.algo.adjust(l.k, l.count, l.period_us, l.burst, now, l.delta, l.mark, ARGV[2])
    if (l.delta < 0 or l.code == 'conc') and ARGV[5 + 5 * n + i - 1] then
      given = (given and given .. ' ' or '') .. ARGV[5 + 5 * n + i - 1]
    end
  end
  reply = reply .. ' ' .. fmt(l.delta)
end
-- Capacity came back before its time: tasks waiting for it (in any worker) look again now
-- rather than at the time their last denial named.
local channel = ARGV[4 + 5 * n]
if given and channel ~= '' then
  redis.call('PUBLISH', channel, given)
end
-- Keep the record (marked settled) until it expires, so that a second settle says so.
redis.call('HSET', lease, 's', '2')
return reply
