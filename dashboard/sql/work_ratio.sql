-- per rank: its mean work of one kind ($kind) per step over steps $first..$last (the steps
-- where it has some), and that amount's ratio to the median rank's (null where the median is 0)
-- columns: rank, amount, value
with
per_rank as (
    select rank, avg(value) as amount
    from dash_work
    where kind = $kind and step between $first and $last
    group by rank
),
middle as (
    select median(amount) as median_amount from per_rank
),
final as (
    select p.rank, p.amount, p.amount / nullif(m.median_amount, 0) as value
    from per_rank as p
    cross join middle as m
)
select * from final
