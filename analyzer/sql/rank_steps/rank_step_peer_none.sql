-- dash_rank_peer of a large run (past a few hundred ranks): no rows, the per-span comparison
-- (rank_step_peer.sql) reads every compute span and collective; the heatmap then compares
-- each rank's own time per step with its peers' (rank_step_grid.sql)
-- columns: rank, step, span_ratio, spans
select null::integer as rank, null::integer as step, null::double as span_ratio,
    0::bigint as spans
where false
