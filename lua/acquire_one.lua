-- acquire_one.lua: the common call, one limit and no acquisition id: acquire.lua's
-- decision for n = 1, without the bookkeeping of several limits and of lease records.
--
-- Sent as prelude.lua and the limit's algorithm file, each up to its "several limits only"
-- line, + this file (throttle/redis/scripts.py): it calls that algorithm's check and commit
-- directly and builds no table, because this runs on every plain acquire and every table
-- and function a script creates costs server time on each call.
--
-- KEYS[1]      the namespace's holds (HASH, see hold.lua)
-- KEYS[2]      the limit's state key
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      max_wait_us   as acquire.lua
-- ARGV[3..6]   count, period_us, burst, cost of the limit: acquire.lua's 5 values of one
--              limit without the code (cost = tokens taken from this limit, >= 0)
-- ARGV[7..8]   the two hold fields of the limit: the whole limit's, this key's ('' if none)
-- ARGV[9]      fence_us      optional: the restart fence (prelude.lua), with its marker
--                            in KEYS[3]; absent: no fence
-- Not for concurrency limits: a holder always has an acquisition id (acquire.lua).
--
-- Returns, when decided, five doubles packed '<ddddd' (40 bytes): allowed (1/0), wait_us,
--   retry_after_us, remaining, reset_us. Packed rather than text: formatting one number in
--   Lua is a C sprintf, and those were the largest part of this script's own time; packed,
--   every value also arrives exact. '2 1' (text, 3 bytes) when the cost exceeds the
--   capacity. A denial writes nothing. While the limit or key is held (hold.lua) the call
--   is denied with retry_after_us = the time until the hold ends, remaining 0, reset 0.

local now = clock_us(ARGV[1])
if ARGV[9] then
  FENCE = fence_of(3, now, tonumber(ARGV[9]))
end
local cost = tonumber(ARGV[6])
local burst = tonumber(ARGV[5])
if cost > burst then
  return '2 1'
end
local held = redis.call('HMGET', KEYS[1], ARGV[7], ARGV[8])
-- Nothing held (false, false) is the usual answer: decode only when something is.
if held[1] or held[2] then
  local hold = math.max(tonumber(held[1]) or 0, tonumber(held[2]) or 0)
  if hold > now then
    return struct.pack('<ddddd', 0, 0, ceil_us(hold - now), 0, 0)
  end
end
local count, period_us = tonumber(ARGV[3]), tonumber(ARGV[4])
local allowed, wait, retry, remaining, reset, s1, s2, s3, s4 =
  check(2, count, period_us, burst, now, cost, tonumber(ARGV[2]))
if allowed == 1 then
  commit(2, count, period_us, burst, now, cost, nil, nil, false, s1, s2, s3, s4)
end
return struct.pack('<ddddd', allowed, wait, retry, remaining, reset)
