"""`search`: Context-1's self-editing search environment (issue 13).

| module | what |
|---|---|
| `reward` | the exact reward, pure functions with named components |
| `quotes` | the quote-matching normalisation cascade of extraction-based verification |
| `generator` | the seeded corpus and tasks: clues, chained hops, distractors, verification, curriculum |
| `tools` | the model's tool schemas, the backend tools with hidden arguments, backend registry |
| `view` | the model's view, budget messages, what a prune rewrites |
| `options` | the environment's options |
| `turn` | one turn's calls under the budget rules |
| `expert` | the scripted expert searcher |
| `env` | the registered environment `search` |
"""

from slipstream.envs.search.env import Search, parse_output, prompt_of
from slipstream.envs.search.generator import GeneratedCorpus, GeneratorOptions, SearchTask, generate_corpus
from slipstream.envs.search.hybrid import bm25_backend, hybrid_backend
from slipstream.envs.search.options import SearchOptions
from slipstream.envs.search.tools import BACKENDS, build_backend, register_backend, render_chunks

register_backend("hybrid", hybrid_backend)
register_backend("bm25", bm25_backend)

__all__ = [
    "BACKENDS",
    "GeneratedCorpus",
    "GeneratorOptions",
    "Search",
    "SearchOptions",
    "SearchTask",
    "build_backend",
    "generate_corpus",
    "parse_output",
    "prompt_of",
    "register_backend",
    "render_chunks",
]
