-- park.lua: park a deferred task in Redis until shortly before its slot.
--
-- KEYS[1]  due       ZSET token -> when to send it back to the broker (us, Redis clock)
-- KEYS[2]  messages  HASH token -> the task's serialized message (opaque to this script)
-- ARGV[1]  now_us    '' = read Redis TIME (always, outside tests)
-- ARGV[2]  token     a new unique id of this parking
-- ARGV[3]  delay_us  how long from now the task is due back at the broker
-- ARGV[4]  payload
-- KEYS[3]  ids       HASH task id -> token (the index of `celery throttle task ID`)
-- KEYS[4]  tasks     HASH token -> task id (so that the index entry leaves with the task)
-- ARGV[5]  task_id   '' = not indexed
-- KEYS[5]  copy      STRING the number of the task's newest copy sent back (optional)
-- ARGV[6]  copy      that number: written with the task, in the same atomic call, so that
--                    a worker killed after parking and before acknowledging the message it
--                    ran leaves that message stale when it is delivered again (a SET after
--                    this call left a window where both the parked copy and the message
--                    delivered again ran)
-- ARGV[7]  copy_ttl_ms
--
-- Returns the due time in us, as a string. The lot's keys have no TTL: a parked task lives
-- until it is released (claim_parked.lua, commit_parked.lua) or purged (purge_parked.lua),
-- and its index entries leave with it: the index is never larger than the lot.

local now = clock_us(ARGV[1])
local due = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
redis.call('ZADD', KEYS[1], due, ARGV[2])
if ARGV[5] and ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[5], ARGV[2])
  redis.call('HSET', KEYS[4], ARGV[2], ARGV[5])
end
if KEYS[5] then
  redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[7])
end
return string.format('%d', due)
