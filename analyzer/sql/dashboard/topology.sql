-- one row per rank: where it runs and its coordinates in the mesh (the analyzer's
-- rank_coords: from the topology table, else from run.json's mesh)
-- columns: rank, host, dp, pp, tp, cp
with
final as (
    select rank, coalesce(host, '?') as host, dp, pp, tp, cp
    from rank_coords
    order by rank
)
select * from final
