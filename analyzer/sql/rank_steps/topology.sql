-- one row per rank: where it runs and its coordinates in the mesh (the analyzer's
-- rank_coords: from the topology table, else from run.json's mesh; a large run's
-- rank_coords leaves hosts to the topology table, read here once)
-- hw_class: the rank's hardware class (topology's hw_class), '' where the run names none
-- columns: rank, host, dp, pp, tp, cp, hw_class
with
hosts as (
    select rank, any_value(host) as host, any_value(nullif(hw_class, '')) as hw_class
    from topology group by rank
),
final as (
    select k.rank, coalesce(k.host, h.host, '?') as host, k.dp, k.pp, k.tp, k.cp,
        coalesce(h.hw_class, '') as hw_class
    from rank_coords as k
    left join hosts as h on h.rank = k.rank
    order by k.rank
)
select * from final
