"""`code`: a sandboxed coding environment with test rewards (Composer 2's harness, issue 14).

tasks.py builds task trees from keys (planted bugs, HumanEval); tools.py binds the six tools to an
episode's sandbox; env.py plays episodes and grades patches in a fresh sandbox.
"""

from slipstream.envs.code.env import Code, CodeOptions, HumanEval, HumanEvalOptions
from slipstream.envs.code.tasks import CodeTask, task_of_key

__all__ = ["Code", "CodeOptions", "CodeTask", "HumanEval", "HumanEvalOptions", "task_of_key"]
