"""Pause and resume across a torch.distributed process group, all or nothing.

    from torch_memory_saver import distributed as tmsd
    reports = tmsd.pause("kv_cache")                     # every rank of the default group
    reports = tmsd.resume(stages=[["weights"], ["kv_cache", "cuda_graph"]])

Every rank of the group calls the same function with the same arguments. The
ranks agree on the call (a gather that is also the barrier: no rank releases
anything before every rank has arrived), each runs the local pause or resume,
and they exchange the outcomes. If every rank succeeded, each gets every rank's
report; if one failed, every rank undoes what the call changed on it (a pause is
resumed, a resume paused again, the failed rank's partial work included) and
every rank raises the same GroupError. A staged resume is one such call: a
failure at a later stage also pauses again the stages already resumed.

Only Python objects go over the group (`all_gather_object`), so gloo and NCCL
both work. With NCCL, `all_gather_object` moves its bytes through the current
CUDA device: set it (`torch.cuda.set_device(local_rank)`) before calling, as
for any object collective. A rank that never makes the call keeps the others
waiting until the group's timeout.

What this does not cover:
- The communicator's own memory (gloo's buffers, NCCL's buffers and
  workspaces) is not paused: it is allocated outside regions.
- A buffer registered with NCCL (NCCL_GRAPH_REGISTER, user buffer
  registration) must stay outside regions, as README's NCCL caveat says: a
  pause would unmap memory NCCL still holds a registration of.
- An undo is by tag: in a tag holding both paused and active memory before the
  call (memory allocated into it after a pause), the undo moves the whole tag.
  An undone pause of a tag without backup gives memory back with undefined
  contents, as any resume of such a tag does.
- If the group itself fails (a rank dies, a timeout), each surviving rank raises a
  GroupError with `broken` set: it names the ranks that did not reach the step
  where the group failed (`lost`, read from markers each rank leaves in the
  group's store before each exchange) and what this rank's call did, which it
  keeps: nothing is undone. With NCCL, a dead peer may instead leave the
  collective waiting until NCCL's own watchdog ends the process.
"""
import threading

from . import _library
from ._errors import Error

__all__ = ["GroupError", "pause", "resume"]

_UNDO = {"pause": "resume", "resume": "pause"}
_DONE = {"pause": "resumed what {} had paused", "resume": "paused again what {} had resumed"}  # {}: it, they
_STAYS = {"pause": "what it could not resume stays paused", "resume": "what it could not pause stays active"}


class GroupError(Error):
    """A group pause or resume failed on at least one rank; every rank of the group
    raises it with the same message, once every rank has undone its part.

    op: "pause" or "resume"; tags: the tags of the failed call (of the failed
    stage in a staged resume); stage: the index into `stages` of the failed stage,
    None for an unstaged call; failures: {group rank: "ExceptionType: message"};
    reports: per group rank, the Report of its call, None where it failed;
    undo_failures: {group rank: error} of the undos that failed in turn.

    When the group itself broke (a rank died, a timeout), only the surviving
    ranks raise it, each its own: broken is True, lost the group ranks that did
    not reach the exchange where it broke (empty if none could be told), moved
    the tags this rank's call moved and keeps moved; nothing was undone."""

    def __init__(self, message, op=None, tags=None, failures=None, reports=None, undo_failures=None, stage=None,
                 broken=False, lost=None, moved=None):
        super().__init__(message)
        self.op, self.tags, self.stage = op, tags, stage
        self.failures = dict(failures or {})
        self.reports = list(reports or [])
        self.undo_failures = dict(undo_failures or {})
        self.broken, self.lost, self.moved = broken, list(lost or []), list(moved or [])

    def __reduce__(self):
        return (type(self), (str(self), self.op, self.tags, self.failures, self.reports, self.undo_failures,
                             self.stage, self.broken, self.lost, self.moved))


def pause(tags=None, group=None):
    """Pauses `tags` (a tag, a list of tags, or None: every tag) on every rank of
    `group` (None: the default group), all or nothing. Returns every rank's
    Report (as torch_memory_saver.pause returns), indexed by group rank; raises
    GroupError, the same on every rank, after undoing, if any rank failed."""
    tags = _check_tags("pause", tags)
    return _run("pause", [tags], False, group)[0]


def resume(tags=None, group=None, *, stages=None):
    """Resumes `tags` (as pause) on every rank of `group`, all or nothing. Returns
    every rank's Report, indexed by group rank.

    stages=[[...], [...]] resumes stage after stage, the ranks agreeing after
    each; returns one list of reports per stage. A failure at any stage pauses
    again, on every rank, what the call resumed: the whole call is all or
    nothing. Pass tags or stages, not both."""
    if stages is None:
        tags = _check_tags("resume", tags)
        return _run("resume", [tags], False, group)[0]
    if tags is not None:
        raise TypeError("torch_memory_saver.distributed.resume: pass tags or stages, not both")
    return _run("resume", _check_stages(stages), True, group)


# ---- arguments ---------------------------------------------------------------


def _native():
    from . import torch_memory_saver as saver

    return _library.load(saver.hook_mode)


def _check_tags(op, tags):
    """None, a str, or a list of str (a tuple becomes a list), checked as the local
    call would check them: a bad argument raises on the rank that passed it,
    before any collective."""
    if isinstance(tags, tuple):
        tags = list(tags)
    if isinstance(tags, list):
        bad = [type(t).__name__ for t in tags if not isinstance(t, str)]
        what = bad and f"a list holding {'an' if bad[0][:1] in 'aeiou' else 'a'} {bad[0]}"
    else:
        what = not (tags is None or isinstance(tags, str)) and type(tags).__name__
    if what:
        raise TypeError(f"torch_memory_saver.distributed.{op}: tags must be None, a str or a list of str, not {what}")
    _native().check_tags(op, tags)
    return tags


def _check_stages(stages):
    """A non-empty list of non-empty lists of str, no tag in two stages."""
    where = "torch_memory_saver.distributed.resume: stages"
    if not isinstance(stages, (list, tuple)) or not stages:
        raise (TypeError if not isinstance(stages, (list, tuple)) else ValueError)(
            f"{where} must be a non-empty list of non-empty lists of tags, not {stages!r}")
    out, seen = [], {}
    for i, stage in enumerate(stages):
        if not isinstance(stage, (list, tuple)) or not all(isinstance(t, str) for t in stage):
            raise TypeError(f"{where}[{i}] must be a list of str, not {stage!r}")
        if not stage:
            raise ValueError(f"{where}[{i}] is empty")
        for t in stage:
            if t in seen:
                raise ValueError(f"{where}: tag {t!r} is in stages[{seen[t]}] and stages[{i}]")
            seen[t] = i
        out.append(_check_tags("resume", list(stage)))
    return out


# ---- the protocol --------------------------------------------------------------


def _group_of(group):
    """(torch.distributed, group, this rank's group rank, group size)."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise RuntimeError(f"torch_memory_saver.distributed: torch.distributed cannot be imported ({e})") from None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch_memory_saver.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(f"torch_memory_saver.distributed: this process (global rank {dist.get_rank()}) "
                           f"is not a member of the group it was given")
    return dist, group, rank, dist.get_world_size(group)


class _Exchange:
    """The ranks' exchanges of one call. Before each, a rank leaves a marker in
    the group's store, so that when the group breaks the survivors can tell which
    ranks never reached the exchange where it broke."""

    _calls = {}  # group -> calls this process made in it: the same count on every rank of the group
    _calls_lock = threading.Lock()

    def __init__(self, dist, group, rank, size):
        self.dist, self.group, self.rank, self.size = dist, group, rank, size
        ranks = dist.get_process_group_ranks(group) if hasattr(dist, "get_process_group_ranks") else range(size)
        name = "-".join(map(str, ranks))
        with _Exchange._calls_lock:
            call = _Exchange._calls[name] = _Exchange._calls.get(name, 0) + 1
        self.prefix = f"torch_memory_saver/{name}/{call}"
        self.store = self._store()
        self.keys = []

    def _store(self):
        try:
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
        except Exception:  # an older or newer torch without it: the lost ranks go unnamed
            return None

    def gather(self, step, obj, broken):
        """Every rank's obj, in rank order; broken(step, lost, error) makes the
        exception raised when the group fails here."""
        key = f"{self.prefix}/{step}"
        try:
            if self.store is not None:
                self.store.set(f"{key}/{self.rank}", "1")
                self.keys.append(f"{key}/{self.rank}")
            out = [None] * self.size
            self.dist.all_gather_object(out, obj, group=self.group)
            return out
        except Exception as e:  # the group failed: a KeyboardInterrupt is not the group's
            raise broken(step, self._missing(key), e) from e

    # A live rank slower than this one may not have left its marker yet when this
    # one's exchange fails: it is given this long to, a lost one never does.
    GRACE_S = 5.0

    def _missing(self, key):
        """Group ranks whose marker for this exchange is not in the store within
        GRACE_S, or None if the store cannot say (it lives on a rank that may be the
        one lost)."""
        if self.store is None:
            return None
        import time

        deadline = time.monotonic() + self.GRACE_S
        try:
            while True:
                missing = [r for r in range(self.size) if not self.store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except Exception:
            return None

    def done(self):
        """Every rank got through the call's exchanges: its markers go (best effort)."""
        for key in self.keys:
            try:
                self.store.delete_key(key)
            except Exception:
                return


def _states():
    from . import torch_memory_saver as saver

    return {r["ptr"]: (r["tag"], r["state"]) for r in saver.allocations()}


def _changed_tags(op, before, allowed):
    """Sorted tags of the allocations this call moved (active to paused for a
    pause, paused to active for a resume), among the tags `allowed` (None: any)."""
    src, dst = ("active", "paused") if op == "pause" else ("paused", "active")
    now = _states()
    tags = {tag for ptr, (tag, state) in before.items()
            if state == src and now.get(ptr, (None, None))[1] == dst}
    return sorted(tags if allowed is None else tags & set(allowed))


def _signature(op, staged, stages):
    return f"{op}(stages={stages!r})" if staged else f"{op}({stages[0]!r})"


def _describe(error):
    return f"{type(error).__name__}: {error}"


def _name(tags):
    return "every tag" if tags is None else repr(tags)


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _failed_on(failures, size):
    """'rank 2 of 4: Error: ...', or the ranks grouped by identical error."""
    by_error = {}
    for rank in sorted(failures):
        by_error.setdefault(failures[rank], []).append(rank)
    if len(by_error) == 1:
        [(error, ranks)] = by_error.items()
        return f"{_ranks(ranks)} of {size}: {error}"
    return f"{len(failures)} of {size} ranks: " + "; ".join(f"{_ranks(r)}: {e}" for e, r in by_error.items())


def _run(op, stages, staged, group):
    """Runs op over the tags of each stage (one stage unless staged), agreeing
    after each; returns the reports of each stage, or raises GroupError after
    every rank undid what the call changed on it."""
    dist, group, rank, size = _group_of(group)
    exchange = _Exchange(dist, group, rank, size)
    call = (op, staged, stages)
    before, undo = None, None

    def broken(step, lost, error):
        stage = (step[1] if isinstance(step, tuple) else 0) if staged else None
        moved = _changed_tags(op, before, None) if before is not None else []
        return _broken_error(op, stages, stage, step, rank, size, lost, error, moved, undo)

    # The barrier: nothing is released before every rank is here.
    calls = exchange.gather("call", call, broken)
    if any(c != call for c in calls):
        raise ValueError("torch_memory_saver.distributed: the ranks of the group called with different arguments: "
                         + "; ".join(f"rank {r}: {_signature(*c)}" for r, c in enumerate(calls)))
    from . import torch_memory_saver as saver

    local = saver.pause if op == "pause" else saver.resume
    out = []
    for k, tags in enumerate(stages):
        outcome, cause = {"rank": rank, "ok": True, "error": None, "report": None}, None
        try:
            if before is None:
                before = _states()
            outcome["report"] = local(tags)
        except Exception as e:  # told to the group; a KeyboardInterrupt is not, and leaves the others waiting
            outcome.update(ok=False, error=_describe(e))
            cause = e
        outcomes = exchange.gather(("outcome", k), outcome, broken)
        if all(o["ok"] for o in outcomes):
            out.append([o["report"] for o in outcomes])
            continue
        allowed = None if tags is None else [t for s in stages[:k + 1] for t in ([s] if isinstance(s, str) else s)]
        undo = _undo(op, before, allowed, rank)
        undos = exchange.gather(("undo", k), undo, broken)
        error = _group_error(op, tags, k if staged else None, len(stages), outcomes, undos)
        exchange.done()
        raise error from cause
    exchange.done()
    return out


_STEPS = {"call": "while the ranks agreed on the call, before any rank {did} anything",
          "outcome": "while the ranks exchanged their outcomes",
          "undo": "while the ranks exchanged what they undid"}


def _broken_error(op, stages, stage, step, rank, size, lost, error, moved, undo):
    """The GroupError a surviving rank raises when the group broke at `step`:
    which ranks did not get there, and what this rank's call left moved."""
    name = step if isinstance(step, str) else step[0]
    done = "paused" if op == "pause" else "resumed"
    what = f"{op} of {_name(stages[0])}" if stage is None else \
        f"{op} of stage {stage + 1} of {len(stages)} ({stages[stage]!r})"
    if lost:
        who = f"{_ranks(lost)} of {size} did not reach it (lost)"
    elif lost is None:
        who = "the group's store cannot say which rank was lost (the rank holding it may be the one)"
    else:
        who = "every rank had reached it (a timeout, or a rank lost during the exchange)"
    mine = f"this rank (rank {rank}) "
    if undo is not None:
        mine += f"had undone its part ({undo['error']})" if undo["error"] else "had undone its part"
        if moved:
            mine += f" but {moved!r} stay{'s' if len(moved) == 1 else ''} {done}"
    elif moved:
        mine += f"{done} {moved!r} and keeps {'them' if len(moved) > 1 else 'it'} {done}"
    else:
        mine += f"had {done} nothing"
    message = (f"torch_memory_saver: {what}: the group broke {_STEPS[name].format(did=done)} "
               f"({_describe(error)}); {who}; {mine}; nothing was undone by the group")
    return GroupError(message, op, stages[0] if stage is None else stages[stage], stage=stage, broken=True,
                      lost=lost or [], moved=moved)


def _group_error(op, tags, stage, stages, outcomes, undos):
    """The GroupError every rank raises, made from what every rank said."""
    failures = {o["rank"]: o["error"] for o in outcomes if not o["ok"]}
    undo_failures = {u["rank"]: u["error"] for u in undos if u["error"]}
    undone = [u["rank"] for u in undos if u["undone"] and not u["error"]]
    size = len(outcomes)
    what = f"{op} of {_name(tags)}" if stage is None else f"{op} of stage {stage + 1} of {stages} ({tags!r})"
    message = f"torch_memory_saver: {what} failed on {_failed_on(failures, size)}"
    if undone:
        message += f"; {_ranks(undone)} " + _DONE[op].format("it" if len(undone) == 1 else "they")
    elif not undo_failures:
        message += f"; no rank had {'paused' if op == 'pause' else 'resumed'} anything to undo"
    if undo_failures:
        message += f"; undoing it failed on {_failed_on(undo_failures, size)} ({_STAYS[op]})"
    reports = [o["report"] for o in outcomes]
    return GroupError(message, op, tags, failures, reports, undo_failures, stage)


def _undo(op, before, allowed, rank):
    """This rank's undo: the inverse op on the tags whose allocations the call moved."""
    from . import torch_memory_saver as saver

    undo = {"rank": rank, "undone": [], "error": None}
    if before is None:  # the snapshot itself failed: the call changed nothing
        return undo
    try:
        undo["undone"] = _changed_tags(op, before, allowed)
        if undo["undone"]:
            getattr(saver, _UNDO[op])(undo["undone"])
    except Exception as e:
        undo["error"] = _describe(e)
    return undo
