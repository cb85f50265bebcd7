-- claim_parked.lua: claim the parked tasks that are due, for one releaser to publish.
--
-- A claim moves a token from `due` to `claimed` (scored by when the claim expires) and
-- gives it a new publish id. The releaser publishes the message with that id, then commits
-- (commit_parked.lua). A releaser that dies between claim and commit leaves its claims to
-- expire; the next claim takes them again under a new publish id, so no task is lost. If it
-- died after publishing, two copies exist; the worker that starts a copy first records its
-- publish id (accept_parked.lua) and the other copy is dropped, so none runs twice.
--
-- KEYS[1]  due       ZSET token -> due us
-- KEYS[2]  messages  HASH token -> payload
-- KEYS[3]  claimed   ZSET token -> claim expiry us
-- KEYS[4]  pub       HASH token -> 'publish_id due_us'
-- ARGV[1]  now_us    '' = read Redis TIME (always, outside tests)
-- ARGV[2]  lead_us   claim tasks due within this time from now
-- ARGV[3]  batch     at most this many tokens per call
-- ARGV[4]  claim_us  how long a claim lasts before another releaser may take it again
-- ARGV[5]  nonce     unique per call; publish ids are nonce .. ':' .. n
--
-- Returns {now_us, token, due_us, publish_id, payload, token, ...} (all strings).

local now = clock_us(ARGV[1])
local batch = tonumber(ARGV[3])
local expiry = now + tonumber(ARGV[4])
local out = {string.format('%d', now)}
local n = 0

local function claim(token, due)
  n = n + 1
  local pub = ARGV[5] .. ':' .. n
  redis.call('ZADD', KEYS[3], expiry, token)
  redis.call('HSET', KEYS[4], token, pub .. ' ' .. due)
  local payload = redis.call('HGET', KEYS[2], token)
  out[#out + 1] = token
  out[#out + 1] = due
  out[#out + 1] = pub
  out[#out + 1] = payload or ''
end

-- Claims whose releaser died first: they are the oldest work.
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, batch)
for _, token in ipairs(stale) do
  local pub = redis.call('HGET', KEYS[4], token)
  local due = pub and string.match(pub, ' (%d+)$') or string.format('%d', now)
  claim(token, due)
end
if n < batch then
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[2]),
                         'WITHSCORES', 'LIMIT', 0, batch - n)
  for i = 1, #due, 2 do
    redis.call('ZREM', KEYS[1], due[i])
    claim(due[i], string.format('%d', tonumber(due[i + 1])))
  end
end
return out
