-- settle.lua: finish an acquisition with its actual cost: refund the unused part or charge
-- the extra to every limit it took from, and release its concurrency units.
--
-- KEYS         the same state keys, in the same order, as the acquisition, then its lease
--              record written by acquire.lua
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      actual cost   '' = as reserved (a plain release)
-- ARGV[3]      acquisition   id (the concurrency holder)
-- ARGV[4]      n             number of limits
-- ARGV[5..]    4 per limit:  code, count, period_us, burst (as for acquire.lua)
--
-- Returns 'status delta'
--   status 0 = settled: delta = actual - reserved, > 0 charged, < 0 refunded;
--          1 = already settled, 2 = unknown or expired lease: nothing changed;
--          3 = the keys differ from those recorded: nothing changed.
-- A refund never raises a bucket above its capacity nor moves a GCRA slot before now; a
-- window refund returns cost only to the window that paid, while it still counts.

local now = clock_us(ARGV[1])
local n = tonumber(ARGV[4])
local lease = KEYS[#KEYS]
local rec = redis.call('HMGET', lease, 's', 'c', 'n')
if rec[1] == false then
  return '2 0'
elseif rec[1] ~= '1' then
  return '1 0'
end
if tonumber(rec[3]) ~= n then
  return '3 0'
end

local fields = {}
for i = 1, n do
  fields[#fields + 1] = 'k' .. i
  fields[#fields + 1] = 'm' .. i
end
local marks = redis.call('HMGET', lease, unpack(fields))

local delta = 0
if ARGV[2] ~= '' then
  delta = tonumber(ARGV[2]) - tonumber(rec[2])
end

local limits = {}
local k = 1
for i = 1, n do
  if marks[2 * i - 1] ~= KEYS[k] then
    return '3 0'
  end
  local l = limit_record(i, k)
  l.mark = marks[2 * i]
  limits[i] = l
  k = k + l.algo.nkeys
end

for i = 1, n do
  local l = limits[i]
  if delta ~= 0 or l.code == 'conc' then
    l.algo.adjust(l.k, l.count, l.period_us, l.burst, now, delta, l.mark, ARGV[3])
  end
end
-- Keep the record (marked settled) until it expires, so that a second settle says so.
redis.call('HSET', lease, 's', '2')
return '0 ' .. fmt(delta)
