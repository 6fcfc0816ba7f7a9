"""`SearchOptions`: the options of the `search` environment (corpus, harness budget rules, reward, expert).

Its own module because the environment, its turn runner and its scripted expert all read them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.envs.search import reward as rw
from slipstream.envs.search.generator import GeneratorOptions

Doc = msgspec.Meta


class SearchOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `search`: the corpus, the harness's budget rules, the reward."""

    corpus_seed: Annotated[int, Doc(description="Seed of the generated corpus and its tasks.")] = 0
    tasks_per_domain: Annotated[int, Doc(description="Tasks generated per domain.")] = 24
    max_hops: Annotated[int, Doc(description="Hop counts min_hops..max_hops.")] = 3
    min_hops: Annotated[int, Doc(description="The fewest hops a task has.")] = 1
    distractors: Annotated[int, Doc(description="Distractor documents per task.")] = 2
    distractor_clue: Annotated[
        Literal["decade", "region"], Doc(description="The first-hop clue a distractor shares: decade or region.")
    ] = "decade"
    hop_distractors: Annotated[
        int, Doc(description="Per later hop, documents that name that hop's entity without being it.")
    ] = 0
    filler_per_domain: Annotated[int, Doc(description="Unrelated documents per domain.")] = 12
    doc_facts: Annotated[int, Doc(description="Extra filler facts per document.")] = 0
    heldout_domain: Annotated[str, Doc(description="The held-out split's domain.")] = "email"
    noise: Annotated[float, Doc(description="Generator slip rate that verification drops.")] = 0.05
    curriculum_phase: Annotated[int, Doc(description="1: skewed to few hops; 2: to many.")] = 1
    min_year: Annotated[int, Doc(description="Earliest year an entity dates from (the latest is 1999).")] = 1600
    unique_clues: Annotated[
        bool,
        Doc(description="No two documents share a (region, decade) pair: one-hop clues single out a document."),
    ] = False
    unique_first_hop: Annotated[
        bool, Doc(description="No other document shares a first hop's (region, decade) pair.")
    ] = False
    short_ids: Annotated[bool, Doc(description="Three-digit document ids drawn at random (417), not w0007.")] = False
    regions: Annotated[int, Doc(description="How many regions entities lie in (6..12).")] = 6
    fixed_offsets: Annotated[
        bool,
        Doc(
            description="Copies at fixed distances: the decade last in the question, a document's year first "
            "and its id last (`Id 417.`); with expert_grep the expert greps `from 187.*north`."
        ),
    ] = False
    varied_nouns: Annotated[
        bool,
        Doc(description="Training tasks draw their nouns (town, emblem, river) from pools; held-out ones keep theirs."),
    ] = False
    backend: Annotated[str, Doc(description="Search backend name (tools.register_backend).")] = "hybrid"
    budget_tokens: Annotated[int, Doc(description="Token budget of the model's context.")] = 2048
    search_tokens: Annotated[int, Doc(description="Most tokens one search/grep/read result may cost.")] = 512
    reserve_tokens: Annotated[int, Doc(description="Kept free for the next response (its max length).")] = 160
    hard_cutoff: Annotated[float, Doc(description="Fraction of the budget past which only prune runs.")] = 0.85
    soft_message: Annotated[
        Literal["train", "always", "never"], Doc(description="When the half-budget suggestion is shown.")
    ] = "train"
    soft_message_share: Annotated[
        float,
        Doc(
            description="With soft_message 'train': the share of training and teacher episodes shown it, a fixed "
            "draw per task (all of a group alike); the rest are played as evaluations see them, so a model that "
            "copies its teacher has seen both contexts (1: every one)."
        ),
    ] = 1.0
    max_turns: Annotated[int, Doc(description="Model turns per episode.")] = 16
    tools_line: Annotated[
        bool, Doc(description="The prompt lists the tools (False: the question only, for short CPU episodes).")
    ] = True
    max_output_docs: Annotated[int, Doc(description="Ranked ids read from the final output.")] = 5
    bytes_per_token: Annotated[float, Doc(description="Token estimate for backend budgets (1: bytes).")] = 1.0
    beta: Annotated[float, Doc(description="F_beta's beta at policy version 0 (Context-1: 4).")] = 4.0
    beta_final: Annotated[float, Doc(description="F_beta's beta once annealed (Context-1: 2).")] = 2.0
    beta_anneal_versions: Annotated[
        int,
        Doc(
            description="Learner steps (policy versions) over which beta goes linearly from `beta` to `beta_final` "
            "(reward.annealed_beta), read from the version that sampled each episode; 0: beta stays `beta`."
        ),
    ] = 0
    floor: Annotated[float, Doc(description="Reward floor for a trajectory that found something.")] = 0.01
    turn_start: Annotated[int, Doc(description="Turn penalty starts (0: 64 scaled with the budget).")] = 0
    turn_end: Annotated[int, Doc(description="Turn penalty peaks (0: 128 scaled with the budget).")] = 0
    expert_stop_rate: Annotated[
        float, Doc(description="Share of tasks on which the expert concludes one hop early (an imperfect teacher).")
    ] = 0.0
    expert_distractor_rate: Annotated[
        float, Doc(description="Share of tasks on which the expert also outputs a non-target document it saw.")
    ] = 0.0
    expert_prune_rate: Annotated[
        float,
        Doc(
            description="Share of tasks on which the expert prunes (a fixed draw per task); on the others it "
            "never prunes, and a refused call makes it conclude with what it has (1: always prunes)."
        ),
    ] = 1.0
    expert_fallback: Annotated[
        Literal["read", "grep"],
        Doc(
            description="When the first hop's search did not surface its document, the expert reads it by id "
            "('read') or greps the clues (region and decade, as expert_grep) first ('grep')."
        ),
    ] = "read"
    expert_grep: Annotated[
        bool, Doc(description="The expert finds the first hop with grep_corpus on the clues (region, decade).")
    ] = False
    expert_slip_rate: Annotated[
        float, Doc(description="With expert_grep: share of tasks whose first grep names the wrong decade.")
    ] = 0.0

    def __post_init__(self) -> None:
        if not 256 <= self.budget_tokens <= 1_000_000:
            raise ValueError(f"budget_tokens must be in 256..1000000, got {self.budget_tokens}")
        if not 0.5 <= self.hard_cutoff <= 1.0:
            raise ValueError(f"hard_cutoff must be in [0.5, 1], got {self.hard_cutoff}")
        if not 16 <= self.reserve_tokens <= self.budget_tokens // 4:
            raise ValueError(f"reserve_tokens must be in 16..budget_tokens/4, got {self.reserve_tokens}")
        if not 1 <= self.search_tokens <= self.budget_tokens:
            raise ValueError(f"search_tokens must be in 1..budget_tokens, got {self.search_tokens}")
        if not 1 <= self.max_turns <= 1024 or not 1 <= self.max_output_docs <= 100:
            raise ValueError("need 1 <= max_turns <= 1024 and 1 <= max_output_docs <= 100")
        if not self.bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0, got {self.bytes_per_token}")
        for name, rate in (
            ("expert_stop_rate", self.expert_stop_rate),
            ("expert_distractor_rate", self.expert_distractor_rate),
            ("expert_slip_rate", self.expert_slip_rate),
            ("expert_prune_rate", self.expert_prune_rate),
            ("soft_message_share", self.soft_message_share),
        ):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if self.curriculum_phase not in (1, 2):
            raise ValueError(f"curriculum_phase must be 1 or 2, got {self.curriculum_phase}")
        if (self.turn_start, self.turn_end) != (0, 0) and not 0 < self.turn_start < self.turn_end:
            raise ValueError(f"need 0 < turn_start < turn_end (or both 0), got {self.turn_start}, {self.turn_end}")
        rw.RewardConfig(beta=self.beta, floor=self.floor)  # validates both
        rw.RewardConfig(beta=self.beta_final)
        if not 0 <= self.beta_anneal_versions <= 1_000_000:
            raise ValueError(f"beta_anneal_versions must be in 0..1000000, got {self.beta_anneal_versions}")
        self.generator()  # validates the corpus options

    def generator(self) -> GeneratorOptions:
        return GeneratorOptions(
            seed=self.corpus_seed,
            tasks_per_domain=self.tasks_per_domain,
            max_hops=self.max_hops,
            min_hops=self.min_hops,
            distractors=self.distractors,
            distractor_clue=self.distractor_clue,
            hop_distractors=self.hop_distractors,
            filler_per_domain=self.filler_per_domain,
            doc_facts=self.doc_facts,
            heldout_domain=self.heldout_domain,
            noise=self.noise,
            min_year=self.min_year,
            unique_clues=self.unique_clues,
            unique_first_hop=self.unique_first_hop,
            short_ids=self.short_ids,
            regions=self.regions,
            fixed_offsets=self.fixed_offsets,
            varied_nouns=self.varied_nouns,
        )

    def beta_at(self, version: int) -> float:
        """F_beta's beta for an episode sampled by policy `version` (the learner steps taken when it
        was published): `beta` at 0, linear to `beta_final` at `beta_anneal_versions`, flat after."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        n = self.beta_anneal_versions
        if n == 0:
            return self.beta
        return rw.annealed_beta(min(version, n), n + 1, start=self.beta, end=self.beta_final)

    def reward_config(self, version: int = 0) -> rw.RewardConfig:
        """The reward's knobs for an episode sampled by policy `version` (beta follows `beta_at`)."""
        start, end = (self.turn_start, self.turn_end)
        if (start, end) == (0, 0):
            start, end = rw.scaled_turn_window(self.budget_tokens)
        return rw.RewardConfig(beta=self.beta_at(version), floor=self.floor, turn_start=start, turn_end=end)
