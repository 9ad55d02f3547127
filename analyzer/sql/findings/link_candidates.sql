-- link_candidates: every unit (a process group, or the two ends of send/recv transfers) with
-- a cheap sign of a slow link, read from digest_collectives without matching ranks: per step,
-- the unit's cost is the mean time per collective of its FASTEST member (the member others
-- waited for waits least, so a late rank barely moves it, while a slow transfer slows every
-- member), compared with the median cost of the units of its class that step.
-- columns: group, unit_a, unit_b, class_a, class_b, n, ratio, late_frac
--   unit_a, unit_b  (gid, -1) for a group; (lower rank, higher rank) for a send/recv pair
--   class_a/b       units compared: a group kind in one pipeline stage (its lowest member's),
--                   or send/recv between the same two stages
--   ratio           median over the steps [$lo, $hi] of cost / class median
--   late_frac       share of the steps with a ratio >= $late
with

keyed as (
    select
        d."group",
        case when d.peer >= 0 then least(d.rank, d.peer) else coalesce(m.gid, 0) end as unit_a,
        case when d.peer >= 0 then greatest(d.rank, d.peer) else -1 end as unit_b,
        d.rank,
        d.step,
        d.busy_ns / d.n_done as cost
    from digest_collectives as d
    left join group_members as m on m."group" = d."group" and m.rank = d.rank and d.peer < 0
    where d.step between $lo and $hi and d.n_done > 0
),

unit_steps as (
    select "group", unit_a, unit_b, step, min(cost) as cost, min(rank) as low_rank
    from keyed
    group by "group", unit_a, unit_b, step
),

classed as (
    select
        u.*,
        ka.pp as class_a,
        case when u.unit_b >= 0 then kb.pp else -1 end as class_b
    from unit_steps as u
    left join rank_coords as ka on ka.rank = case when u.unit_b >= 0 then u.unit_a else u.low_rank end
    left join rank_coords as kb on kb.rank = u.unit_b
),

ratios as (
    select
        *,
        cost / nullif(median(cost) over (partition by "group", class_a, class_b, step), 0)
            as ratio
    from classed
),

final as (
    select
        "group",
        unit_a,
        unit_b,
        any_value(class_a) as class_a,
        any_value(class_b) as class_b,
        count(ratio) as n,
        median(ratio) as ratio,
        avg(case when ratio >= $late then 1.0 else 0.0 end) as late_frac
    from ratios
    group by "group", unit_a, unit_b
)

select * from final
