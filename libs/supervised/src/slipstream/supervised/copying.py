"""A synthetic copy curriculum that gives a small model from scratch its induction heads.

Every agentic demo needs the policy to copy a string from wherever it sits in the context: a
question into a sub-agent's assignment (swarm), a fact into a summary (recall), a clue's unseen
words into a tool call (search). The micro preset learns such copies only at a fixed distance
from their source: trained on the marked-copy task below alone it stayed at chance (loss ~3.0
against ln 26 = 3.26) for 6,000 steps. Trained on dense repeats (`copy_example`: every copied
token is a target) the same model's induction cliff falls at ~1,000 steps (30 s on one CPU
thread): 0.22 -> 0.97 per-token copy accuracy between steps 900 and 1,100 (seed 0, lowercase). Pretrained
so, and with a few such rows kept in every later batch (the heads drift away otherwise), it
learns the marked copy in 300-400 steps (seeds 0 and 1). The figures are in
libs/supervised/README.md, "Copy pretraining".

One example, byte for byte (`alphabet` defaults to lowercase letters and digits):

    [bos]k3 qzp|wq0fhxe2tnlb|wq0fhxe2tnlb\\n[eos]
           noise | source   | target (trained)

The noise in front moves the source, so the copy never sits at a fixed distance. Segments are
encoded separately and joined as ids, so a BPE tokenizer cannot merge a source token with its
delimiter and the target's ids equal the source's.
"""

from __future__ import annotations

import random
import string

from slipstream.engine.tokenizer import Tokenizer

# One training example: token ids and, per id, whether it is a trained target (warmstart.Example).
Example = tuple[list[int], list[bool]]

# The heads form on lowercase letters and digits. With upper case too (62 symbols) the micro
# preset's cliff had not fallen after 4,000 steps (loss 3.77 against ln 62 = 4.13), and extending
# formed heads to upper case broke them on one seed of two (seed 1: exact copies 0.72 -> 0.00). The
# heads copy the symbols they were formed on: plans keep what must be copied in this alphabet.
ALPHABET = string.ascii_lowercase + string.digits
MIN_LEN = 12
MAX_LEN = 30
MAX_NOISE = 20


def copy_example(
    tokenizer: Tokenizer,
    rng: random.Random,
    *,
    alphabet: str = ALPHABET,
    min_len: int = MIN_LEN,
    max_len: int = MAX_LEN,
    max_noise: int = MAX_NOISE,
) -> Example:
    """One dense copy example: [bos] noise | source | source \\n [eos], the second source, the
    newline and the eos trained."""
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if max_noise < 0:
        raise ValueError(f"max_noise must be >= 0, got {max_noise}")
    source = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
    noise = "".join(rng.choice(alphabet + " ") for _ in range(rng.randint(0, max_noise)))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    context = [*bos, *tokenizer.encode(noise + "|"), *tokenizer.encode(source), *tokenizer.encode("|")]
    target = [*tokenizer.encode(source), *tokenizer.encode("\n"), tokenizer.eos_id]
    return [*context, *target], [False] * len(context) + [True] * len(target)


def copy_examples(tokenizer: Tokenizer, n: int, seed: int, *, alphabet: str = ALPHABET) -> list[Example]:
    """`n` dense copy examples, the same for the same seed."""
    rng = random.Random(f"copy/{seed}")
    return [copy_example(tokenizer, rng, alphabet=alphabet) for _ in range(n)]
