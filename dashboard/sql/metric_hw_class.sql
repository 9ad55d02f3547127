-- per rank: its hardware class's time factor over steps $first..$last: the median own time
-- (step minus collectives) of its class's ranks over that of the fastest class, each class's
-- median taken per pipeline stage and context index and then over them (ranks of one stage do
-- the same work); null for a rank without a class (topology's hw_class)
-- columns: rank, value
with
owned as (
    select
        s.rank,
        t.pp,
        t.cp,
        t.hw_class,
        greatest(s.step_ns - s.comm_ns, 0) as own_ns
    from dash_rank_step as s
    inner join dash_topology as t using (rank)
    where s.step between $first and $last and t.hw_class <> ''
),
cells as (
    select hw_class, pp, cp, median(own_ns) as own_ns
    from owned
    group by hw_class, pp, cp
),
classes as (
    select hw_class, median(own_ns) as own_ns
    from cells
    group by hw_class
),
factors as (
    select hw_class, own_ns / nullif(min(own_ns) over (), 0) as value
    from classes
),
final as (
    select t.rank, f.value
    from dash_topology as t
    inner join factors as f using (hw_class)
)
select * from final
