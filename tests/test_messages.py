from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, RootModel, computed_field
from typing_extensions import TypedDict

from mappa_graph import instrument
from mappa_graph.messages import to_jsonable


class Blob:
    """The app's own type, which pydantic cannot serialise to JSON."""

    def __repr__(self) -> str:
        return "Blob()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blob)

    __hash__ = object.__hash__


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no")


class WithBlob(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    blob: Blob | None = None


class Attachment(BaseModel):
    data: bytes


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)
    blob: Blob

    @computed_field  # type: ignore[prop-decorator]
    @property
    def label(self) -> str:
        return "L"


class Blobs(RootModel[list[bytes]]):
    pass


@dataclasses.dataclass
class Point:
    x: int
    scale: dataclasses.InitVar[int] = 1
    kind: ClassVar[str] = "point"

    def __post_init__(self, scale: int) -> None:
        self.x *= scale


def test_what_pydantic_cannot_write_as_json_is_kept_as_far_as_it_can_be() -> None:
    assert to_jsonable(WithBlob(name="a", blob=Blob())) == {"name": "a", "blob": "Blob()"}
    assert to_jsonable(Attachment(data=b"\xff\x00")) == {"data": repr(b"\xff\x00")}
    assert to_jsonable([Unprintable()]) == ["<Unprintable whose repr() raised>"]
    assert to_jsonable(Loose(blob=Blob(), plan="keep me")) == {"blob": "Blob()", "plan": "keep me", "label": "L"}
    assert to_jsonable(Blobs([b"\xff"])) == [repr(b"\xff")]


def test_a_dataclass_gives_its_fields_and_a_dataclass_type_its_name() -> None:
    assert to_jsonable(Point(2, scale=5)) == {"x": 10}  # no InitVar, no ClassVar
    assert to_jsonable({"cls": Point}) == {"cls": repr(Point)}


def test_a_graph_whose_state_pydantic_cannot_serialise_still_records_its_episodes() -> None:
    from langgraph.graph import START, StateGraph

    class State(TypedDict):
        q: str
        item: WithBlob | None
        attachment: Attachment | None

    def build():
        graph = StateGraph(State)
        graph.add_node("load", lambda s: {"item": WithBlob(name=s["q"], blob=Blob()),
                                          "attachment": Attachment(data=b"\xff")})
        graph.add_node("finish", lambda s: {"q": s["q"] + "!"})
        graph.add_edge(START, "load")
        graph.add_edge("load", "finish")
        return graph.compile()

    for background in (True, False):
        app = instrument(build(), background=background)
        assert app.invoke({"q": "hi"}) == build().invoke({"q": "hi"})
        _, episode = app.run_episode({"q": "ho"}, task_id="t")
        app.flush()
        assert len(app.episodes) == 2
        assert episode.final_state["item"] == {"name": "ho", "blob": "Blob()"}
        assert [a.node for a in episode.actions] == ["load", "finish"]
