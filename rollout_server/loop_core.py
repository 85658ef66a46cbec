"""What the rollout loop's two sides share: the components that hold its groups, the persisted
state, and the one lock that guards them all (docs/DESIGN.md §6).

The loop's thread (`rollout_server.rollout.RolloutLoop`: admit → dispatch → collect) and the
trainer's calls (`rollout_server.trainer_link.TrainerLink`: Pull, Ack, UpdateWeights) both hold a
`LoopCore`. Admission counts a group as running (`Generation.running`), queued or leased
(`Deliveries`), so every move of a group between them happens under `lock`, in one step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from rollout_api.admission import ServerAdmission
from rollout_server.delivery import Deliveries
from rollout_server.generation import Generation
from rollout_server.persistence import RolloutState, StateStore, new_server_id
from rollout_server.prompt_book import PromptBook
from sat_jax.config import RolloutConfig


@dataclasses.dataclass(eq=False)
class LoopCore:
    """The rollout loop's shared parts; every field but `store` and `clock` is guarded by `lock`.

    Attributes:
      state: the persisted state; its admission and prompt parts are written from their owners
        at every save (`save_locked`).
      store: where it persists (group commit: `StateStore.submit` under `lock`, `wait` outside).
      admission: the admission state (`ServerAdmission`; it owns its persisted part).
      generation: the groups running and their samples.
      deliveries: the finished groups, queued or leased.
      prompts: the prompts dispatched and not acknowledged, and the prompt stream's position.
      clock: the loop's one monotonic clock, in seconds.
      sleep: waits that many seconds of `clock`.
      draining: `RolloutLoop.drain` was called: admission is closed for good.
    """

    state: RolloutState
    store: StateStore
    admission: ServerAdmission
    generation: Generation
    deliveries: Deliveries
    prompts: PromptBook
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    draining: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def restore(
        cls,
        state: RolloutState,
        store: StateStore,
        cfg: RolloutConfig,
        generation: Generation,
        prompts: PromptBook,
        *,
        lease_s: float,
        max_response_bytes: int,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> LoopCore:
        """The parts of a loop that starts from `state` (admission restored from it by
        `ServerAdmission.set_state`; a `server_id` drawn if it has none yet), with `cfg`'s
        admission parameters and queue capacity and `Deliveries`' lease and response limits."""
        if not state.server_id:
            state.server_id = new_server_id()
        admission = ServerAdmission(
            max_staleness=cfg.max_staleness,
            batch_groups=cfg.batch_groups,
            capacity=cfg.queue_groups,
        )
        admission.set_state(state.admission, weights_version=state.version)
        deliveries = Deliveries(
            capacity=cfg.queue_groups,
            admission=admission,
            lease_s=lease_s,
            max_response_bytes=max_response_bytes,
            clock=clock,
        )
        return cls(state, store, admission, generation, deliveries, prompts, clock, sleep)

    def outstanding_ids_locked(self) -> set[int]:
        """Ids of the groups queued, leased or running."""
        return self.deliveries.ids() | set(self.generation.running)

    def sync_locked(self) -> None:
        """Brings `state` up to date with the parts its owners keep: the prompt book's and
        admission's (`ServerAdmission.get_state`)."""
        self.prompts.save_to(self.state)
        self.state.admission = self.admission.get_state()

    def save_locked(self) -> int:
        """Hands a snapshot of the state to the store's writer and returns its number, which a
        reply revealing the change waits for (`StateStore.wait`, outside the lock). A failed write
        is logged and retried (`retry_failed_save`); the state in memory stays as it is."""
        self.sync_locked()
        return self.store.submit(self.state)

    def retry_failed_save(self) -> None:
        """Writes the state again if the last write failed, and waits for that write."""
        self.store.wait(self.store.retry())
