"""Node paths and agent boundaries: which agent a node task belongs to.

A node task's place in a LangGraph run is its checkpoint namespace, `researcher:<task id>|agent:<task id>`:
one `name:task id` segment per graph level, outermost first. Its node path is the names alone,
`("researcher", "agent")`, written `researcher/agent`. By default the agent is the path's first name, the
outermost node below the instrumented graph: a supervisor's or swarm's worker, a subgraph node, or a plain node
(whose path has one name). A graph that a tool call runs (LangChain's subagents as tools) is a boundary too: its
nodes' paths carry the tool's name (`tools/ask_researcher/model`), and when no node above it is a graph of its own,
the tool is their agent (`ask_researcher`). `agents=` changes that with a mapping over paths (the longest
matching prefix wins) or a function of the path. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

START_NODE = "__start__"
INTERNAL_NODES = frozenset({START_NODE, "__end__"})

AgentsSpec = Mapping[str, str] | Callable[[tuple[str, ...]], str | None]


def node_path(checkpoint_ns: str, root_ns: str | None = None) -> tuple[str, ...]:
    """The node names of a checkpoint namespace, below the instrumented graph's own namespace (set when that
    graph itself runs inside another graph's node). The counters LangGraph inserts when one node task runs
    graphs more than once (`team:<id>|2|draft:<id>`: a loop over `sub.invoke`, two agents called in turn, a
    retried subgraph node) say which run it was, not where: they are left out of the path."""
    if root_ns and checkpoint_ns.startswith(root_ns + "|"):
        checkpoint_ns = checkpoint_ns[len(root_ns) + 1 :]
    return tuple(segment.split(":", 1)[0] for segment in checkpoint_ns.split("|") if not segment.isdigit())


def enclosing_ns(checkpoint_ns: str) -> str | None:
    """The namespace of the node task a namespace's graph runs inside (None at the top), past any run counter
    (`team:<id>` for `team:<id>|2|draft:<id>`)."""
    parts = checkpoint_ns.split("|")[:-1]
    while parts and parts[-1].isdigit():
        parts.pop()
    return "|".join(parts) or None


def is_internal(path: tuple[str, ...]) -> bool:
    """`__start__` (with the router of a conditional START edge, as in a swarm) and `__end__` are LangGraph's
    plumbing, not anyone's turn."""
    return any(name in INTERNAL_NODES for name in path)


def graph_paths(graph: Any) -> list[str]:
    """Every node path of a compiled graph that LangGraph can see statically: its nodes, and the nodes of the
    subgraphs they run (prebuilt agents, supervisor and swarm workers), at any depth."""
    paths = [name for name in getattr(graph, "nodes", {}) if name not in INTERNAL_NODES]
    try:
        subgraphs = list(graph.get_subgraphs(recurse=True))
    except Exception:  # noqa: BLE001 - a node LangGraph cannot inspect (a remote graph): outer names still hold
        return paths
    for namespace, subgraph in subgraphs:
        prefix = namespace.replace("|", "/")
        paths += [f"{prefix}/{name}" for name in getattr(subgraph, "nodes", {}) if name not in INTERNAL_NODES]
    return list(dict.fromkeys(paths))


class AgentResolver:
    """Maps a node path to its agent: `agents[path]` for the longest mapped prefix of the path, or
    `agents(path)` when it is a function (None falls back to the default), else the default: the agent boundary
    the builder found (the path's first name unless a tool call ran the graph)."""

    def __init__(self, agents: AgentsSpec | None = None) -> None:
        if agents is not None and not callable(agents) and not isinstance(agents, Mapping):
            raise TypeError(f"agents= takes a mapping of node paths to agent names or a function of the path "
                            f"tuple, got {type(agents).__name__}")
        self.function = agents if callable(agents) and not isinstance(agents, Mapping) else None
        self.mapping = {} if self.function is not None or agents is None else dict(agents)  # type: ignore[arg-type]
        bad = {k: v for k, v in self.mapping.items() if not isinstance(k, str) or not isinstance(v, str) or not v}
        if bad:
            raise TypeError(f"agents= maps node paths to agent names (non-empty strings); these entries are not: "
                            f"{', '.join(f'{k!r}: {v!r}' for k, v in bad.items())}")
        self._cache: dict[tuple[tuple[str, ...], str | None], str] = {}

    def __call__(self, path: tuple[str, ...], default: str | None = None) -> str:
        agent = self._cache.get((path, default))
        if agent is None:
            agent = self._cache[(path, default)] = self._resolve(path, default)
        return agent

    def _resolve(self, path: tuple[str, ...], default: str | None) -> str:
        if self.function is not None:
            agent = self.function(path)
            if agent is not None:
                if not isinstance(agent, str) or not agent:
                    raise TypeError(f"the agents= function returned {agent!r} for node path {'/'.join(path)!r}; "
                                    "it must return an agent name (a non-empty string) or None for the default")
                return agent
        for end in range(len(path), 0, -1):
            agent = self.mapping.get("/".join(path[:end]))
            if agent is not None:
                return agent
        return default or path[0]

    def check(self, graph: Any) -> None:
        """Refuse mapping keys that name no node path of `graph`, naming the paths there are. A key below a
        node path whose inside LangGraph cannot see (a graph built inside the node's function or run by a tool)
        is accepted. A function is tried on every path LangGraph can see, so one
        that raises or returns something other than a name fails here, before any run, not in the trace
        writer."""
        if self.function is not None:
            for path in graph_paths(graph):
                try:
                    self._resolve(tuple(path.split("/")), None)
                except Exception as error:  # the user's function: say where it failed
                    raise ValueError(f"agents= failed on node path {path!r}: {type(error).__name__}: {error}; "
                                     "fix the function (it gets the path as a tuple of node names)") from error
            return
        if not self.mapping:
            return
        paths = graph_paths(graph)
        known = set(paths)
        # a node path with nothing below it that LangGraph can see may still run graphs (in its function, or
        # by a tool: `researcher/tools/ask_expert`), so keys below it are taken on trust
        opaque = {p for p in paths if not any(q.startswith(p + "/") for q in paths)}

        def fits(key: str) -> bool:
            names = key.split("/")
            if names[-1] == START_NODE and len(names) > 1:  # a subgraph's router: its node's path must fit
                return fits("/".join(names[:-1]))
            return all(names) and (key in known or key == START_NODE
                                   or any("/".join(names[:end]) in opaque for end in range(1, len(names))))

        unknown = [key for key in self.mapping if not fits(key)]
        if unknown:
            raise ValueError(
                f"unknown node {', '.join(repr(k) for k in unknown)} in agents= (graph node paths: "
                f"{', '.join(paths)}); key agents= by a node path such as 'worker' or 'worker/agent', or pass "
                "a function of the path"
            )
