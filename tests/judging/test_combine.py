"""Composed judges: MixJudge (weighted mean of scored parts) and OutcomeJudge (the outcome-only baseline)."""

from __future__ import annotations

import asyncio

import pytest

from mappa_graph.errors import JudgeError
from mappa_graph.judging.combine import MixJudge, OutcomeJudge
from mappa_graph.judging.llm_judge import LLMJudge
from mappa_graph.judging.protocol import ProcessJudge
from mappa_graph.judging.verifier import VerifierJudge
from mappa_graph.testing import ScriptedChatModel
from mappa_graph.traces import Action, Episode


def make_episode(n: int = 3) -> Episode:
    episode = Episode(input="2+2?", reference="4", final_state={"answer": "4"})
    agents = ["solver", "executor", "verifier"]
    for i in range(n):
        episode.actions.append(Action(episode_id=episode.id, node=agents[i % 3], agent=agents[i % 3], index=i,
                                      output_message={"role": "assistant", "content": f"step {i}"}))
    return episode


def constant(value, name="const"):
    return VerifierJudge(lambda action, episode, reference: value, name=name)


def test_mix_is_the_weighted_mean_of_its_parts():
    mix = MixJudge([(constant(1.0, "a"), 3), (constant(0.0, "b"), 1)])
    assert isinstance(mix, ProcessJudge) and mix.name == "mix(a*3, b*1)"
    rewards = mix.score(make_episode(3))
    assert [r.score for r in rewards] == [0.75, 0.75, 0.75]
    assert rewards[0].rationale.startswith("a (w=3): 1.000") and "b (w=1): 0.000" in rewards[0].rationale
    assert rewards[0].judge == mix.name and rewards[0].unscored_reason is None


def test_a_failed_part_leaves_the_mix_unscored_and_names_it():
    """Issue 13 item 11: when one part was unscored the mix silently returned the other part's score."""
    def half_abstains(action, episode, reference):
        return None if action.index == 0 else 0.2

    mix = MixJudge([(constant(0.8, "a"), 1), (VerifierJudge(half_abstains, name="b"), 1)])
    first, second = mix.score(make_episode(2))
    assert first.score is None and first.unscored_reason.startswith("a part left it unscored: b: judge 'b' abstained")
    assert second.score == pytest.approx(0.5)
    nobody = MixJudge([(constant(None, "a"), 1), (VerifierJudge(lambda *a: 1 / 0, name="b"), 2)])
    (reward,) = nobody.score(make_episode(1))
    assert reward.score is None and reward.unscored_reason.startswith("a part left it unscored")
    assert "a: judge 'a' abstained" in reward.unscored_reason and "ZeroDivisionError" in reward.unscored_reason


def test_renormalising_over_the_parts_that_answered_is_an_opt_in_on_record():
    def half_abstains(action, episode, reference):
        return None if action.index == 0 else 0.2

    mix = MixJudge([(constant(0.8, "a"), 1), (VerifierJudge(half_abstains, name="b"), 1)],
                   on_failed_part="renormalize")
    first, second = mix.score(make_episode(2))
    assert first.score == pytest.approx(0.8) and "renormalised without: b: judge 'b' abstained" in first.rationale
    assert second.score == pytest.approx(0.5) and "renormalised" not in second.rationale
    with pytest.raises(ValueError, match="on_failed_part"):
        MixJudge([(constant(0.8, "a"), 1)], on_failed_part="ignore")


def test_mix_with_an_llm_judge_and_part_filters():
    llm = LLMJudge(ScriptedChatModel(reply=lambda messages: '{"score": 6, "rationale": "fine"}'))
    only_verifier = VerifierJudge(lambda *a: 1.0, name="exact", agents=["verifier"])
    mix = MixJudge([(llm, 1), (only_verifier, 1)])
    episode = make_episode(3)
    rewards = mix.score(episode)
    assert [r.score for r in rewards] == pytest.approx([0.6, 0.6, 0.8])
    assert "exact (w=1): not judged" in rewards[0].rationale
    assert [r.score for r in asyncio.run(mix.ascore(episode))] == pytest.approx([0.6, 0.6, 0.8])


@pytest.mark.parametrize("parts, error", [
    ([], "at least one"),
    ([(constant(1.0), 0)], "positive number"),
    ([(constant(1.0), float("nan"))], "positive number"),
    ([(object(), 1)], "is not a judge"),
    ([constant(1.0)], "pair"),
])
def test_mix_rejects_bad_parts(parts, error):
    with pytest.raises((TypeError, ValueError), match=error):
        MixJudge(parts)


def test_outcome_judge_gives_every_action_the_outcome_and_sets_it():
    judge = OutcomeJudge(lambda state, reference: state["answer"] == reference, name="exact-answer")
    assert isinstance(judge, ProcessJudge)
    episode = make_episode(3)
    rewards = judge.score(episode)
    assert [r.score for r in rewards] == [1.0, 1.0, 1.0] and episode.outcome == 1.0
    assert {r.judge for r in rewards} == {"exact-answer"} and rewards[0].rationale == "episode outcome 1"
    episode.final_state = {"answer": "5"}
    assert [r.score for r in judge.score(episode, episode.actions[:1])] == [0.0] and episode.outcome == 0.0
    verifier_only = OutcomeJudge(lambda s, r: 0.5, agents=["verifier"], set_outcome=False)
    fresh = make_episode(3)
    assert [r.agent for r in verifier_only.score(fresh)] == ["verifier"] and fresh.outcome is None


@pytest.mark.parametrize("fn, reason", [
    (lambda s, r: None, "abstained"),
    (lambda s, r: 1 / 0, "raised ZeroDivisionError"),
    (lambda s, r: 3.0, "invalid outcome"),
    (lambda s, r: "yes", "invalid outcome"),
])
def test_outcome_judge_failures_leave_the_episode_unscored(fn, reason):
    episode = make_episode(2)
    rewards = OutcomeJudge(fn).score(episode)
    assert [r.score for r in rewards] == [None, None] and reason in rewards[0].unscored_reason
    assert episode.outcome is None
    with pytest.raises(JudgeError, match=reason):
        OutcomeJudge(fn, strict=True).score(make_episode(1))


def test_outcome_only_baseline_mixed_with_process_scores():
    process = VerifierJudge(lambda action, episode, reference: 0.1 * action.index, name="process")
    outcome = OutcomeJudge(lambda state, reference: 1.0, name="outcome")
    rewards = MixJudge([(process, 1), (outcome, 1)]).score(make_episode(3))
    assert [r.score for r in rewards] == pytest.approx([0.5, 0.55, 0.6])
