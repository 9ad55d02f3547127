-- chrome_ranks: the ranks that have topology, spans or collectives, with mesh coordinates.
-- output columns: rank, dp, pp, tp, cp, host
with present as (
    select rank from topology
    union
    select distinct rank from spans
    union
    select distinct rank from collectives
),

final as (
    select p.rank, c.dp, c.pp, c.tp, c.cp, c.host
    from present as p
    left join rank_coords as c on p.rank = c.rank
    order by p.rank
)

select * from final
