-- step_range: the steps the run recorded.
-- columns: first_step, last_step, n_steps, common_last_step, finished_step, unfinished
--   common_last_step  the last step every rank that reported got to (min over ranks of max)
--   finished_step     the last step every rank that reported closed (its `step` span
--                     written); null where a rank wrote no `step` span
--   unfinished        collectives recorded without an end (a hang or a crash left them)
with

all_steps as (
    select rank, step from digest_spans where step >= 0
    union all
    select rank, step from digest_collectives where step >= 0
),

per_rank as (
    select rank, max(step) as last_step from all_steps group by rank
),

closed as (
    select rank, max(step) filter (where step_span_ns is not null) as closed_step
    from digest_spans where step >= 0 group by rank
),

final as (
    select
        (select min(step) from all_steps) as first_step,
        (select max(step) from all_steps) as last_step,
        (select count(distinct step) from all_steps) as n_steps,
        (select min(last_step) from per_rank) as common_last_step,
        (
            select case when count(closed_step) = count(*) then min(closed_step) end
            from per_rank left join closed using (rank)
        ) as finished_step,
        (select coalesce(sum(n_rows - n_done), 0) from digest_collectives) as unfinished
)

select * from final
