-- the dashboard's digest of the work table: per rank, step and kind, the work summed over
-- microbatches and keys; an all_to_all's bytes count at the rank that received them (the
-- a2a_sent rows whose key is that rank, every sender's), as kind a2a_recv
-- columns: rank, step, kind, value
with
given as (
    select rank, step, kind, value
    from work
    where kind in ('tokens', 'expert_tokens')
),
received as (
    select key as rank, step, 'a2a_recv' as kind, value
    from work
    where kind = 'a2a_sent' and key >= 0
),
final as (
    select rank, step, kind, sum(value) as value
    from (
        select * from given
        union all
        select * from received
    )
    group by rank, step, kind
)
select * from final
