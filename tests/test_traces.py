from mappa_graph import Action, Episode, Reward
from mappa_graph.traces import ToolCall, ToolResult


def test_episode_json_round_trip_keeps_everything() -> None:
    action = Action(
        node="coder", agent="coder", step=2, checkpoint_ns="coder:abc",
        input_messages=[{"role": "user", "content": "hi"}],
        output_message={"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "py", "args": {"code": "1"}}]},
        tool_calls=[ToolCall(id="c1", name="py", args={"code": "1"})],
        tool_results=[ToolResult(tool_call_id="c1", name="py", output="1", error=None, latency_s=0.1)],
        prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5], output_logprobs=[-0.5, -1.25], token_source="backend",
    )
    episode = Episode(run="r", task_id="t1", input={"q": 1}, final_state={"a": [1, 2]}, reference="42",
                      outcome=1.0, actions=[action], metadata={"seed": 3})
    again = Episode.model_validate_json(episode.model_dump_json())
    assert again == episode
    assert again.actions[0].trainable and again.agents == ["coder"]
    reward = Reward(action_id=action.id, episode_id=episode.id, agent="coder", judge="j", score=None,
                    unscored_reason="judge raised")
    assert Reward.model_validate_json(reward.model_dump_json()) == reward and not reward.scored


def test_node_action_without_tokens_is_not_trainable() -> None:
    assert not Action(kind="node", node="tools", agent="tools").trainable
    assert not Action(node="coder", agent="coder", prompt_token_ids=[1], output_token_ids=[]).trainable


def test_ids_keep_the_uuid4_hex_shape_and_do_not_repeat() -> None:
    """Ids are stored, exported and joined on as 32 hex digits (the shape uuid4().hex gave)."""
    import re

    from mappa_graph.traces import new_id

    ids = [new_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
