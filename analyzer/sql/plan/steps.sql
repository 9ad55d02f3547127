-- plan/steps: the first step and the step count of the run's spans.
-- columns: first_step, last_step
with

final as (
    select min(step) as first_step, max(step) as last_step
    from spans
    where name = 'step' and end_ns is not null
)

select * from final
