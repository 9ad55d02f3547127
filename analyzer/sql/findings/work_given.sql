-- work_given: the work each rank was given per step of [$lo, $hi] (the work table, docs/spec.md
-- §2), one row per (rank, step, kind).
-- columns: rank, step, kind, value
--   tokens         its data-parallel replica's tokens, over the step's microbatches
--   attention      the sum of the squared document lengths of those microbatches
--   expert_tokens  the token assignments the experts it holds received (every expert summed)
--   a2a_bytes      the bytes every all_to_all sent to it: the a2a_sent rows whose key (the
--                  peer) is the rank, whoever recorded them
with

given as (
    select rank, step, kind, sum(value)::double as value
    from work
    where step between $lo and $hi and kind in ('tokens', 'attention', 'expert_tokens')
    group by rank, step, kind
),

received as (
    select key as rank, step, 'a2a_bytes' as kind, sum(value)::double as value
    from work
    where step between $lo and $hi and kind = 'a2a_sent' and key >= 0
    group by key, step
)

select * from given
union all
select * from received
