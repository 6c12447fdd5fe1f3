"""Membership and lanes: whose each request is, which requests are resident,
and the order in which users and their streams are served.

One part of :class:`vllm_output_rate.policy.gate.StepGate`; plain Python, no quota
and no vLLM.  A *lane* holds one user's requests; :class:`Lanes` keeps the
lanes in service order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Iterator

if TYPE_CHECKING:
    from vllm_output_rate.policy.residency import Residency

Key = Hashable


@dataclass
class Lane:
    """One user's requests that take part in the rotation.

    ``progressing`` holds resident prefills that can advance without
    sampling (an ordered set, admission order).  ``decoding`` holds resident
    requests that must sample, in rotation order (the front is served next),
    and, among them, ``waiting`` requests that are not resident yet but take
    their turn like a stream (see :meth:`Lanes.wait_in_turn`).
    """

    decoding: deque[Key] = field(default_factory=deque)
    progressing: dict[Key, None] = field(default_factory=dict)
    waiting: int = 0

    def __len__(self) -> int:
        """Resident requests of the user (in-turn waiting ones not counted)."""
        return len(self.decoding) - self.waiting + len(self.progressing)  # inline: per step

    def resident_streams(self) -> int:
        """Resident requests of the user that must sample to progress."""
        return len(self.decoding) - self.waiting

    def rotate_front(self, offered: list[Key], served: Iterable[Key]) -> None:
        """``offered`` was the front of the rotation: its ``served`` keys move
        to the back, the rest keep their places (keys may have left since)."""
        decoding = self.decoding
        front = min(len(offered), len(decoding))
        if served == offered and list(islice(decoding, front)) == offered:
            # Every offered key served and all still at the front (lists
            # compare by identity first): a plain rotation, the common case.
            decoding.rotate(-front)
            return
        head = [decoding.popleft() for _ in range(front)]
        served_set = set(served)
        decoding.extendleft(reversed([key for key in head if key not in served_set]))
        decoding.extend(key for key in head if key in served_set)

    def served_to_back(self, served: set[Key]) -> None:
        """Keys in ``served`` move behind all others; both groups keep their order."""
        decoding = self.decoding
        rest = [key for key in decoding if key not in served]
        self.decoding = deque(rest + [key for key in decoding if key in served])


class Lanes:
    """Users' lanes in service order, least recently served first.

    Invariants (checked by ``tests/policy/test_gate_parts.py``):

    * a tracked key has one user for as long as it is tracked (``user_of``);
    * a resident key is in exactly one place: its user's lane, in
      ``progressing`` or ``decoding`` (``lane_of`` maps it to that user);
    * an in-turn waiting key sits in its user's ``decoding``, is counted by
      the lane's ``waiting`` and is not resident; admitted, it keeps its place;
    * a lane lives from its user's first admission (or in-turn wait) until
      the user's last tracked request is forgotten, so a user whose requests
      were all preempted keeps its place in the service order;
    * ``version`` changes whenever the resident set, whether a resident
      request is progressing, or the in-turn set changes.
    """

    def __init__(self) -> None:
        #: Every tracked key -> its user.
        self.user_of: dict[Key, str] = {}
        #: Resident key -> its user.
        self.lane_of: dict[Key, str] = {}
        #: Waiting keys that take turns in their user's rotation.
        self.in_turn: set[Key] = set()
        #: user -> lane, in service order (least recently served first).
        self.order: OrderedDict[str, Lane] = OrderedDict()
        #: Bumped on every membership change (see the class invariants).
        self.version = 0
        self._tracked_per_user: dict[str, int] = {}
        self._admitted_at: dict[Key, int] = {}  # resident key -> admission number
        self._admissions = 0
        #: How many requests each user may hold resident
        #: (:class:`~vllm_output_rate.policy.residency.Residency`, set by the
        #: gate's owner); None: no residency cap.
        self.residency: Residency | None = None
        #: A waiting request whose turn came found no room (KV) and no
        #: request has left since: no token is kept for admissions until one
        #: does (vLLM admits nothing past such a refusal; the resident
        #: streams, whose progress frees the room, go first).
        self.room_wanted = False

    def track(self, key: Key, user: str) -> None:
        """Remember the user of a request (resolved once, at arrival)."""
        if key not in self.user_of:
            self._tracked_per_user[user] = self._tracked_per_user.get(user, 0) + 1
        self.user_of[key] = user

    def wait_in_turn(self, key: Key, priority_of: Callable[[Key], int] | None = None) -> None:
        """Put a waiting request at the back of its user's rotation, to be
        admitted when the rotation reaches it (no-op if resident or there).

        ``priority_of`` (priority scheduling: a smaller value is more
        important): it goes ahead of its user's keys that are less important
        instead, so its turn comes before theirs (a user's urgent request is
        not queued behind its own long streams)."""
        if key in self.in_turn or key in self.lane_of:
            return
        lane = self._lane(self.user_of[key])
        decoding = lane.decoding
        if priority_of is None:
            decoding.append(key)
        else:
            urgency = priority_of(key)
            for index, other in enumerate(decoding):
                if priority_of(other) > urgency:
                    decoding.insert(index, key)
                    break
            else:
                decoding.append(key)
        lane.waiting += 1
        self.in_turn.add(key)
        self.version += 1

    def forget(self, key: Key) -> None:
        """The request is gone for good (finished or aborted)."""
        self.release(key)
        if key in self.in_turn:
            self._leave_turn(key, self.user_of[key]).decoding.remove(key)
        user = self.user_of.pop(key, None)
        if user is None:
            return
        left = self._tracked_per_user[user] - 1
        if left:
            self._tracked_per_user[user] = left
            return
        del self._tracked_per_user[user]
        lane = self.order.get(user)
        if lane is not None and not lane:
            del self.order[user]

    def admit(self, key: Key, progressing: bool) -> None:
        """The request became resident (holds KV and a model-runner slot).

        A user without a lane joins the service order at the back; an
        in-turn request keeps its place in the rotation unless progressing.
        """
        user = self.user_of[key]
        lane = self._lane(user)
        self.lane_of[key] = user
        self._admissions += 1
        self._admitted_at[key] = self._admissions
        self.version += 1
        if key in self.in_turn:
            self._leave_turn(key, user)
            if not progressing:
                return
            lane.decoding.remove(key)
        if progressing:
            lane.progressing[key] = None
        else:
            lane.decoding.append(key)

    def release(self, key: Key) -> None:
        """The request stopped being resident (preempted, finished); its user
        keeps the lane (see the class invariants)."""
        user = self.lane_of.pop(key, None)
        if user is None:
            return
        del self._admitted_at[key]
        self.version += 1
        self.room_wanted = False
        lane = self.order[user]
        if key in lane.progressing:
            del lane.progressing[key]
        else:
            lane.decoding.remove(key)

    def set_progressing(self, key: Key, progressing: bool) -> None:
        """Move a resident request between prefills and streams (a stream
        joins the back of the rotation); ignored if not resident."""
        user = self.lane_of.get(key)
        if user is None:
            return
        lane = self.order[user]
        if progressing:
            if key not in lane.progressing:
                lane.decoding.remove(key)
                lane.progressing[key] = None
                self.version += 1
        elif key in lane.progressing:
            del lane.progressing[key]
            lane.decoding.append(key)
            self.version += 1

    def resident(self) -> Iterator[Key]:
        """Every resident key: lane by lane, prefills before streams."""
        in_turn = self.in_turn
        for lane in self.order.values():
            yield from lane.progressing
            if lane.waiting:
                yield from (key for key in lane.decoding if key not in in_turn)
            else:
                yield from lane.decoding

    def resident_count(self, user: str) -> int:
        """Resident requests of ``user`` (how many is ``len(lane_of)``)."""
        lane = self.order.get(user)
        return 0 if lane is None else len(lane)

    def tracked_users(self) -> int:
        """How many users have a tracked request (resident or waiting)."""
        return len(self._tracked_per_user)

    def in_admission_order(self, keys: list[Key]) -> None:
        """Sort resident ``keys`` in place into the order they became resident."""
        keys.sort(key=self._admitted_at.__getitem__)

    def _lane(self, user: str) -> Lane:
        lane = self.order.get(user)
        if lane is None:
            lane = self.order[user] = Lane()
        return lane

    def _leave_turn(self, key: Key, user: str) -> Lane:
        self.in_turn.discard(key)
        lane = self.order[user]
        lane.waiting -= 1
        self.version += 1
        return lane
