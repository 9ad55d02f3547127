-- the steps the dashboard can show
-- columns: first_step, last_step, ranks
with
final as (
    select min(step) as first_step, max(step) as last_step, count(distinct rank) as ranks
    from dash_rank_step
)
select * from final
