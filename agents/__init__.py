"""Reference teams built as a LangGraph user would build them: data analysis (planner -> coder -> analyst), math
(solver -> verifier) and arithmetic (planner -> calculator). Not part of the `mappa_graph` wheel; a checkout set
up by scripts/setup.sh has them on its path."""
