-- compare/blocked: the time each rank was blocked in collectives in steps [$lo, $hi], summed
-- per (rank, step, group, op) and per the phase span that holds the call (null: none does).
-- columns: rank, step, group, op, phase, blocked_ns
--   blocked_ns  end - the time the rank began to wait, as the digests' busy_ns
--               (digest/collectives.sql): from the call or wait() of a host-timed row, from
--               the device start where known, from the posting of a recv; finished rows only
--               (a row flushed unfinished and again finished counts once); sends count only
--               when $sends_block (a host-timed run: gloo's send holds its caller until the
--               receiver takes the data; on a device a send shares its kernel with the recv)
--   phase       data, forward, backward or optimizer: the span of the rank and step that
--               began last at or before the row's start, when it holds that start (its time
--               is that phase's span time, but spent waiting: analyzer/compare.py takes it
--               out of the phase)
with

rows as (
    select
        rank,
        step,
        "group",
        op,
        coalesce(
            wait_from_ns,
            case
                when source = 'host' then start_ns
                when op = 'send' then coalesce(start_ns, issue_ns)
                when op = 'recv' then issue_ns
                else coalesce(start_ns, issue_ns)
            end
        ) as from_ns,
        end_ns
    from collectives_timed
    where step between $lo and $hi and end_ns is not null
        and (op <> 'send' or $sends_block)
),

phase_spans as (
    select
        rank,
        step,
        case when kind = 'data' then 'data' else name end as phase,
        start_ns,
        end_ns
    from spans
    where step between $lo and $hi and end_ns is not null
        and (kind = 'data' or name in ('forward', 'backward', 'optimizer'))
),

final as (
    -- the phase span that began last at or before the row's start, if the start is inside it
    select
        r.rank,
        r.step,
        r."group",
        r.op,
        case when r.from_ns < p.end_ns then p.phase end as phase,
        sum(greatest(r.end_ns - r.from_ns, 0))::bigint as blocked_ns
    from rows as r
    asof left join phase_spans as p
        on p.rank = r.rank and p.step = r.step and r.from_ns >= p.start_ns
    group by all
)

select * from final
