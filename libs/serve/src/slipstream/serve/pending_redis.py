"""`RedisPending`: the pending stage in Redis, shared by every endpoint replica of a run.

Each transition is one Lua script, so a feedback post racing a flush, a deadline or a group's
formation on another replica sees one order of events, never half of one. Keys (all under the
run's hash tag `slipstream:{<run>}`, so the scripts work on a cluster too):

| key | type | what |
|---|---|---|
| `serve:episodes` | hash | session -> episodes numbered so far (episode ids never repeat) |
| `serve:call:<call id>` | string | the episode the call was served into (TTL `retention_s`) |
| `serve:last:<session>` | string | the session's latest call (implicit signals, session targets) |
| `serve:ep:<episode id>` | hash | state, body key, deadline, group, `k:<key>` per signal key seen |
| `serve:fb:<episode id>` | hash | feedback id -> JSON `FeedbackSignal` |
| `serve:<env>:deadlines`, `:ready`, `:releasing` | sorted sets | pending by deadline, ready, claimed |
| `serve:<env>:groups` / `:counts` | counter / hash | groups formed; flushed, feedback, masked, released, ... |
| `serve:<env>:group:<key>` | hash | a group key's `want` (members it asks for) and `gone` (masked this round) |
| `serve:<env>:gready:<key>` | sorted set | the key's ready members, by ready time |
| `serve:<env>:keyed_complete`, `:keyed_waiting` | sorted sets | keys with ready members, by the oldest: done / not |

Episode and feedback keys expire `retention_s` after their deadline (or after release), so a
late post is still answered (409, or "duplicate" for a retry) for that long and nothing grows
without bound; a group key's two keys expire `retention_s` after it was last touched (never
before a member's deadline). Everything is in Redis, so a restarted serving process (or another
replica) forms the groups its predecessor left filling.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec

from slipstream.control import ControlClient
from slipstream.control.keyspace import Keyspace
from slipstream.schemas import FeedbackSignal
from slipstream.serve.pending import Member, PendingPolicy, Verdict, ordered

# Keys as ARGV runs: ARGV[first] = n, then n keys. `counting`: a signal of one of the reward keys
# (none given: any signal); `releasable`: that, and every release key (ARGV[at] = n_release,
# the release keys, then n_reward and the reward keys).
_RELEASABLE = """
local function counting(ep, fb, first)
  local n = tonumber(ARGV[first])
  if n == 0 then return redis.call('HLEN', fb) > 0 end
  for i = first + 1, first + n do
    if redis.call('HEXISTS', ep, 'k:' .. ARGV[i]) == 1 then return true end
  end
  return false
end
local function releasable(ep, fb, at)
  local n = tonumber(ARGV[at])
  for i = at + 1, at + n do
    if redis.call('HEXISTS', ep, 'k:' .. ARGV[i]) == 0 then return false end
  end
  return counting(ep, fb, at + n + 1)
end
"""

# Group keys. The calling script's last two ARGV are the group prefix (`serve:<env>:`) and the TTL
# (ms) its group keys are kept at least for. `regroup` files a key with ready members under
# keyed_complete (ready + gone >= want) or keyed_waiting, scored by its oldest ready member.
_GROUPS = """
local function keep(key, ttl)
  if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
end
local function regroup(g)
  local pre, ttl = ARGV[#ARGV - 1], ARGV[#ARGV]
  local gready, info = pre .. 'gready:' .. g, pre .. 'group:' .. g
  redis.call('ZREM', pre .. 'keyed_waiting', g)
  redis.call('ZREM', pre .. 'keyed_complete', g)
  keep(info, ttl)
  local n = redis.call('ZCARD', gready)
  if n == 0 then return end
  keep(gready, ttl)
  local first = redis.call('ZRANGE', gready, 0, 0, 'WITHSCORES')[2]
  local want = tonumber(redis.call('HGET', info, 'want') or '1')
  local gone = tonumber(redis.call('HGET', info, 'gone') or '0')
  local where = 'keyed_waiting'
  if n + gone >= want then where = 'keyed_complete' end
  redis.call('ZADD', pre .. where, first, g)
end
local function group_of(ep)
  local g = redis.call('HGET', ep, 'group_key')
  if not g or g == '' then return nil end
  local info = ARGV[#ARGV - 1] .. 'group:' .. g
  redis.call('HSETNX', info, 'want', redis.call('HGET', ep, 'group_want') or '1')
  return g
end
local function make_ready(ep, eid, now, ready_set)
  redis.call('HSET', ep, 'state', 'ready', 'ready_at', now)
  local g = group_of(ep)
  if not g then
    redis.call('ZADD', ready_set, now, eid)
    return
  end
  redis.call('ZADD', ARGV[#ARGV - 1] .. 'gready:' .. g, now, eid)
  regroup(g)
end
local function group_gone(ep)
  local g = group_of(ep)
  if not g then return end
  redis.call('HINCRBY', ARGV[#ARGV - 1] .. 'group:' .. g, 'gone', 1)
  regroup(g)
end
"""

# KEYS: ep, call, last. ARGV: episode id, call id, ttl_ms (PEXPIRE GT needs Redis 7: done by hand)
_NOTE = """
redis.call('HSETNX', KEYS[1], 'state', 'open')
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
"""

# KEYS: ep, fb, ready, deadlines, counts. ARGV: fid, json, key, now, eid, release keys, reward keys,
# group prefix, group ttl_ms
_ADD = (
    _RELEASABLE
    + _GROUPS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'unknown' end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 'duplicate' end
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'open' and st ~= 'pending' and st ~= 'ready' then return 'too_late' end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], 'k:' .. ARGV[3], '1')
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
redis.call('HINCRBY', KEYS[5], 'feedback', 1)
if st == 'pending' and releasable(KEYS[1], KEYS[2], 6) then
  redis.call('ZREM', KEYS[4], ARGV[5])
  make_ready(KEYS[1], ARGV[5], ARGV[4], KEYS[3])
end
return 'recorded'
"""
)

# KEYS: ep, fb, ready, deadlines, counts. ARGV: eid, body_key, deadline, now, ttl_ms, release keys,
# reward keys, group key ('' none), members it asks for, group prefix, group ttl_ms (= ttl_ms)
_FLUSHED = (
    _RELEASABLE
    + _GROUPS
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if st and st ~= 'open' then return st end
redis.call('HSET', KEYS[1], 'state', 'pending', 'body_key', ARGV[2], 'deadline', ARGV[3],
           'group_key', ARGV[#ARGV - 3], 'group_want', ARGV[#ARGV - 2])
local g = group_of(KEYS[1])
if g then regroup(g) end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[5]) end
redis.call('HINCRBY', KEYS[5], 'flushed', 1)
if releasable(KEYS[1], KEYS[2], 6) then
  make_ready(KEYS[1], ARGV[1], ARGV[4], KEYS[3])
  return 'ready'
end
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
return 'pending'
"""
)

# KEYS: deadlines, ready, counts. ARGV: now, publish_unrated, ep prefix, fb prefix, retention_ms, reward keys,
# group prefix, group ttl_ms
_EXPIRE = (
    _RELEASABLE
    + _GROUPS
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 256)
local masked = {}
for _, eid in ipairs(due) do
  redis.call('ZREM', KEYS[1], eid)
  local ep = ARGV[3] .. eid
  if redis.call('HGET', ep, 'state') == 'pending' then
    if counting(ep, ARGV[4] .. eid, 6) or ARGV[2] == '1' then
      make_ready(ep, eid, ARGV[1], KEYS[2])
    else
      redis.call('HSET', ep, 'state', 'masked')
      redis.call('PEXPIRE', ep, ARGV[5])
      redis.call('HINCRBY', KEYS[3], 'masked', 1)
      group_gone(ep)
      table.insert(masked, eid)
    end
  end
end
return masked
"""
)

# KEYS: ready, groups, releasing, counts. ARGV: size, now, wait_s, ep prefix, group id prefix,
# group_timeout_s, group prefix, group ttl_ms
_FORM = (
    _GROUPS
    + """
local function claim(take)
  local gid = ARGV[5] .. redis.call('INCR', KEYS[2])
  local out = {gid}
  for i, eid in ipairs(take) do
    local ep = ARGV[4] .. eid
    redis.call('HSET', ep, 'state', 'releasing', 'group_id', gid, 'group_index', tostring(i - 1),
               'group_size', tostring(#take), 'claimed_at', ARGV[2])
    redis.call('ZADD', KEYS[3], ARGV[2], eid)
    table.insert(out, eid)
    table.insert(out, redis.call('HGET', ep, 'body_key') or '')
  end
  return out
end
-- A keyed group first: complete, or its oldest ready member waited group_timeout_s; oldest first.
local pre = ARGV[#ARGV - 1]
local now = tonumber(ARGV[2])
local c = redis.call('ZRANGE', pre .. 'keyed_complete', 0, 0, 'WITHSCORES')
local w = redis.call('ZRANGEBYSCORE', pre .. 'keyed_waiting', '-inf', now - tonumber(ARGV[6]),
                     'WITHSCORES', 'LIMIT', 0, 1)
local g = nil
if #c > 0 and #w > 0 then
  local cs, ws = tonumber(c[2]), tonumber(w[2])
  if cs < ws or (cs == ws and c[1] < w[1]) then g = c[1] else g = w[1] end
elseif #c > 0 then g = c[1]
elseif #w > 0 then g = w[1] end
if g then
  local gready, info = pre .. 'gready:' .. g, pre .. 'group:' .. g
  local want = tonumber(redis.call('HGET', info, 'want') or '1')
  local take = redis.call('ZRANGE', gready, 0, want - 1)
  redis.call('HINCRBY', KEYS[4], 'groups_by_key', 1)
  if #take < want then redis.call('HINCRBY', KEYS[4], 'groups_partial', 1) end
  redis.call('HSET', info, 'gone', '0')
  for _, eid in ipairs(take) do redis.call('ZREM', gready, eid) end
  regroup(g)
  return claim(take)
end
-- Then episodes without a key, in arrival order.
local n = redis.call('ZCARD', KEYS[1])
if n == 0 then return {} end
local size = tonumber(ARGV[1])
if n < size then
  local wait = tonumber(ARGV[3])
  if wait <= 0 then return {} end
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if now - tonumber(oldest[2]) < wait then return {} end
end
local take = redis.call('ZRANGE', KEYS[1], 0, size - 1)
for _, eid in ipairs(take) do redis.call('ZREM', KEYS[1], eid) end
return claim(take)
"""
)

# KEYS: ep, fb, releasing, counts. ARGV: eid, retention_ms
_RELEASED = """
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'releasing' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'released')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
redis.call('HINCRBY', KEYS[4], 'released', 1)
return 1
"""


class RedisPending:
    """The pending stage in Redis (see the module docstring for the keys)."""

    def __init__(self, policy: PendingPolicy, client: ControlClient) -> None:
        self.policy = policy
        self.client = client
        ks = Keyspace(policy.run_id or "default")
        self._k = ks.key
        self._env = policy.env
        self._retention_ms = int(policy.retention_s * 1000)
        self._note = client.script(_NOTE)
        self._add = client.script(_ADD)
        self._flushed = client.script(_FLUSHED)
        self._expire = client.script(_EXPIRE)
        self._form = client.script(_FORM)
        self._released = client.script(_RELEASED)

    @classmethod
    def connect(cls, policy: PendingPolicy, url: str, *, timeout_s: float = 2.0) -> RedisPending:
        return cls(policy, ControlClient(url, timeout_s=timeout_s))

    # ------------------------------------------------------------------ keys
    def _ep(self, eid: str) -> str:
        return self._k("serve", "ep", eid)

    def _fb(self, eid: str) -> str:
        return self._k("serve", "fb", eid)

    def _set(self, name: str) -> str:
        return self._k("serve", self._env, name)

    def _key_runs(self) -> list[str | int]:
        p = self.policy
        return [len(p.release_keys), *p.release_keys, len(p.reward_keys), *p.reward_keys]

    def _group_args(self, ttl_ms: int | None = None) -> list[str | int]:
        """The last two ARGV of every script that moves an episode into or out of a group key."""
        return [self._set(""), max(ttl_ms or 0, self._retention_ms)]

    def _episode_keys(self, eid: str) -> list[str]:
        return [self._ep(eid), self._fb(eid), self._set("ready"), self._set("deadlines"), self._set("counts")]

    # ------------------------------------------------------------------ calls and sessions
    async def next_episode(self, session_id: str) -> int:
        n = await self.client.call("serve.next_episode", lambda r: r.hincrby(self._k("serve", "episodes"), session_id))
        return int(n) - 1

    async def note_call(self, call_id: str, session_id: str, episode_id: str) -> None:
        keys = [self._ep(episode_id), self._k("serve", "call", call_id), self._k("serve", "last", session_id)]
        args = [episode_id, call_id, self._retention_ms]
        await self.client.call("serve.note_call", lambda r: self._note(keys=keys, args=args, client=r))

    async def last_call(self, session_id: str) -> str | None:
        got = await self.client.call("serve.last_call", lambda r: r.get(self._k("serve", "last", session_id)))
        return str(got) if got else None

    async def episode_of_call(self, call_id: str) -> str | None:
        got = await self.client.call("serve.episode_of_call", lambda r: r.get(self._k("serve", "call", call_id)))
        return str(got) if got else None

    async def state(self, episode_id: str) -> str | None:
        got = await self.client.call("serve.state", lambda r: r.hget(self._ep(episode_id), "state"))
        return str(got) if got else None

    # ------------------------------------------------------------------ feedback
    async def add_feedback(self, episode_id: str, signal: FeedbackSignal, now: float) -> Verdict:
        args: list[str | int] = [signal.feedback_id, msgspec.json.encode(signal).decode(), signal.key, repr(now)]
        args += [episode_id, *self._key_runs(), *self._group_args()]
        keys = self._episode_keys(episode_id)
        got = await self.client.call("serve.feedback", lambda r: self._add(keys=keys, args=args, client=r))
        verdict = str(got)
        assert verdict in ("recorded", "duplicate", "too_late", "unknown"), verdict
        return verdict  # type: ignore[return-value]

    async def flushed(
        self, episode_id: str, body_key: str, deadline: float, now: float, group_key: str = "", group_size: int = 0
    ) -> str:
        ttl = int((max(deadline - now, 0.0) + self.policy.retention_s) * 1000)
        args = [episode_id, body_key, repr(deadline), repr(now), ttl, *self._key_runs()]
        args += [group_key, self.policy.want(group_size), *self._group_args(ttl)]
        keys = self._episode_keys(episode_id)
        got = await self.client.call("serve.flushed", lambda r: self._flushed(keys=keys, args=args, client=r))
        return str(got)

    async def feedback(self, episode_id: str) -> list[FeedbackSignal]:
        raw = await self.client.call("serve.read_feedback", lambda r: r.hvals(self._fb(episode_id)))
        return ordered([msgspec.json.decode(v, type=FeedbackSignal) for v in raw])

    # ------------------------------------------------------------------ deadlines and groups
    async def expire(self, now: float) -> list[str]:
        keys = [self._set("deadlines"), self._set("ready"), self._set("counts")]
        args = [repr(now), "1" if self.policy.publish_unrated else "0", self._ep(""), self._fb(""), self._retention_ms]
        args += [len(self.policy.reward_keys), *self.policy.reward_keys, *self._group_args()]
        got = await self.client.call("serve.expire", lambda r: self._expire(keys=keys, args=args, client=r))
        return [str(e) for e in got]

    async def form_group(self, now: float) -> list[Member]:
        p = self.policy
        keys = [self._set("ready"), self._set("groups"), self._set("releasing"), self._set("counts")]
        args = [p.group_size, repr(now), repr(p.group_wait_s), self._ep(""), p.group_id(0)[:-1]]
        args += [repr(p.group_timeout_s), *self._group_args()]
        got = await self.client.call("serve.form_group", lambda r: self._form(keys=keys, args=args, client=r))
        if not got:
            return []
        gid, rest = str(got[0]), [str(x) for x in got[1:]]
        pairs = list(zip(rest[::2], rest[1::2], strict=True))
        return [
            Member(episode_id=eid, body_key=key, group_id=gid, group_index=i, group_size=len(pairs))
            for i, (eid, key) in enumerate(pairs)
        ]

    async def stale_releasing(self, now: float, older_than_s: float) -> list[Member]:
        eids = await self.client.call(
            "serve.releasing", lambda r: r.zrangebyscore(self._set("releasing"), "-inf", repr(now - older_than_s))
        )
        out = []
        for eid in map(_text, eids):
            fields = await self.client.call("serve.releasing", partial(_member_fields, self._ep(eid)))
            state, key, gid, index, size = fields
            if state != "releasing":
                continue
            out.append(Member(episode_id=eid, body_key=key, group_id=gid, group_index=int(index), group_size=int(size)))
        return out

    async def released(self, episode_id: str) -> None:
        keys = [self._ep(episode_id), self._fb(episode_id), self._set("releasing"), self._set("counts")]
        args = [episode_id, self._retention_ms]
        await self.client.call("serve.released", lambda r: self._released(keys=keys, args=args, client=r))

    async def counts(self) -> dict[str, int]:
        raw = await self.client.call("serve.counts", lambda r: r.hgetall(self._set("counts")))
        return {_text(k): int(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self.client.close()


def _text(value: object) -> str:
    """A key or member as the control client returns it (decode_responses: always str)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a decoded string from Redis, got {value!r}")
    return value


async def _member_fields(episode_key: str, redis: Any) -> Any:
    return await redis.hmget(episode_key, "state", "body_key", "group_id", "group_index", "group_size")
