"""Reports rendered for people, in one home: the findings report (text, markdown, JSON, HTML),
the wording they share, and the reports of compare, whatif, fleet and the windows of a long
run. Each takes the report's dict (docs/spec.md) and returns text; none reads a run."""
