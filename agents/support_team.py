"""A customer-support team written the way a LangGraph user writes one, with no mappa import: a
`langgraph-supervisor` supervisor over two `create_react_agent` workers whose model is a plain `ChatOpenAI`.

The model's address and key come from the environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`), as for any
OpenAI-compatible server; examples/existing_app.py points them at mappa's policy endpoint and trains each
worker's adapter without touching this file.
"""

from __future__ import annotations

import warnings
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph_supervisor import create_supervisor

with warnings.catch_warnings():  # moved to langchain.agents in LangGraph 1.0; still what supervisor teams use
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

WORKERS = ("researcher", "writer")

_ORDERS = {"A17": "shipped on May 2, arrived damaged", "B42": "delivered on time", "C99": "lost in transit"}


@tool
def lookup_order(order_id: str) -> str:
    """Look up an order's shipping history by its id (e.g. A17)."""
    return _ORDERS.get(order_id.strip().upper(), f"no order {order_id}")


@tool
def refund_policy(reason: str) -> str:
    """The refund rule for a complaint reason (damaged, lost, late)."""
    rules = {"damaged": "full refund or replacement", "lost": "full refund", "late": "10% credit"}
    return rules.get(reason.strip().lower(), "no refund; offer help")


def build_support_team(*, model: str = "gpt-4o-mini", supervisor_model: BaseChatModel | None = None,
                       worker_model: BaseChatModel | None = None, max_tokens: int | None = None,
                       streaming: bool = False) -> Any:
    """The compiled team. `supervisor_model` / `worker_model` replace the supervisor's / the workers'
    ChatOpenAI (any chat model with tool calling); `max_tokens` and `streaming` go to the workers' ChatOpenAI
    (the supervisor's asks for no length: the server's default applies)."""
    llm = worker_model or ChatOpenAI(model=model, max_tokens=max_tokens, streaming=streaming)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        researcher = create_react_agent(llm, [lookup_order], name="researcher",
                                        prompt="You are the researcher. Find the facts of the customer's order.")
        writer = create_react_agent(llm, [refund_policy], name="writer",
                                    prompt="You are the writer. Write the customer a short, kind reply.")
    supervisor = create_supervisor(
        [researcher, writer], model=supervisor_model or ChatOpenAI(model=model),
        prompt="You lead a support team: send the researcher first, then the writer, then answer.")
    return supervisor.compile()
