-- accept_parked.lua: may this published copy of a parked task run?
--
-- KEYS[1]  run        STRING: the publish id of the copy that started first
-- ARGV[1]  publish_id of the copy about to start
-- ARGV[2]  ttl_ms     how long to remember it (longer than any redelivery of the message)
--
-- Returns 1 when this copy may run: it is the first to start, or it is the same copy again
-- (the broker redelivered it after its worker died); 0 for another copy (a releaser
-- published twice), which must be dropped.

if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return 1
end
return 0
