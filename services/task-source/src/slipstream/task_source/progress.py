"""The learner's progress as the task source sees it: newest version, newest step, acks it still holds.

Fed from two fan-out subjects: `learner.step` (one LearnerStep per committed optimizer step) and
`weights.announce` (a version is stored). Messages of other runs are ignored. The newest version
known from either bounds `min_policy_version`; the newest step decides when the run is finished.

Held trajectories: the learner acks the trajectories of a step only once a checkpoint covers it
(every `checkpoint_every` steps), so the ones trained since the last checkpoint still look
outstanding in TRAJ_SCORED. They are the `n_trajectories` of the steps after the last multiple of
`checkpoint_every`; steps before this process started are not known, so right after a restart the
count can be low (the window is then briefly tighter, never wider).
"""

from __future__ import annotations

from slipstream.schemas import LearnerStep, WeightAnnounce


class LearnerProgress:
    def __init__(self, run_id: str, *, checkpoint_every: int = 1) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.run_id = run_id
        self.checkpoint_every = checkpoint_every
        self.latest_version = -1  # -1: nothing known yet
        self.latest_step = 0  # steps are numbered from 1
        self._step_sizes: dict[int, int] = {}

    def on_step(self, msg: LearnerStep) -> bool:
        """Take one learner.step message; False when it belongs to another run."""
        if msg.run_id != self.run_id:
            return False
        self.latest_version = max(self.latest_version, msg.policy_version)
        self.latest_step = max(self.latest_step, msg.step)
        self._step_sizes[msg.step] = msg.n_trajectories
        covered = self.last_checkpoint_step()
        for step in [s for s in self._step_sizes if s <= covered]:
            del self._step_sizes[step]
        return True

    def on_announce(self, msg: WeightAnnounce) -> bool:
        """Take one weights.announce message; False when it belongs to another run."""
        if msg.run_id != self.run_id:
            return False
        self.latest_version = max(self.latest_version, msg.policy_version)
        return True

    def last_checkpoint_step(self) -> int:
        """The newest step a checkpoint covers (0: none yet)."""
        return (self.latest_step // self.checkpoint_every) * self.checkpoint_every

    def held_trajectories(self) -> int:
        """Trajectories trained after the last checkpoint, whose acks the learner still holds."""
        covered = self.last_checkpoint_step()
        return sum(n for step, n in self._step_sizes.items() if step > covered)

    def finished(self, max_steps: int) -> bool:
        """True once the learner reported step `max_steps` (never when max_steps is 0)."""
        return max_steps > 0 and self.latest_step >= max_steps
