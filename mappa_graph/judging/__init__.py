"""Judging: score every action of an episode in context (process rewards), check the judge, record corrections.

Never imports torch or langgraph (enforced by tests/test_import_rules.py): a judge can run anywhere a trace can
be read, including a Ray worker without a model.
"""

from __future__ import annotations

from .combine import MixJudge, OutcomeJudge
from .llm_judge import LLMJudge
from .overrides import effective_rewards, override_score
from .protocol import EpisodeItem, Judge, ProcessJudge
from .report import JudgeReport, judge_report
from .verifier import VerifierJudge

__all__ = [
    "EpisodeItem",
    "Judge",
    "JudgeReport",
    "LLMJudge",
    "MixJudge",
    "OutcomeJudge",
    "ProcessJudge",
    "VerifierJudge",
    "effective_rewards",
    "judge_report",
    "override_score",
]
