-- commit_parked.lua: forget released tasks once their messages are at the broker.
--
-- KEYS[1..4]  due, messages, claimed, pub (as for claim_parked.lua)
-- KEYS[5..6]  ids (task id -> token), tasks (token -> task id): the index (park.lua)
-- ARGV        token, publish_id pairs
--
-- A token is forgotten only if its claim still carries that publish id: a releaser whose
-- claim expired and was taken by another commits nothing. Returns the number forgotten.

local function forget_index(token)
  local task = redis.call('HGET', KEYS[6], token)
  if task then
    -- The task may have been parked again under a new token already: keep that one.
    if redis.call('HGET', KEYS[5], task) == token then
      redis.call('HDEL', KEYS[5], task)
    end
    redis.call('HDEL', KEYS[6], token)
  end
end

local done = 0
for i = 1, #ARGV, 2 do
  local token, pub = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', KEYS[4], token)
  if current and string.sub(current, 1, #pub + 1) == pub .. ' ' then
    redis.call('ZREM', KEYS[3], token)
    redis.call('HDEL', KEYS[2], token)
    redis.call('HDEL', KEYS[4], token)
    forget_index(token)
    done = done + 1
  end
end
return done
