-- whatif/ops: the operations a what-if replays, one row per span or collective row of a rank.
-- Spans: every finished one but the `step` spans (they hold the others), `recompute` spans
-- (inside a backward, whose time holds them), `background` spans (work beside the training
-- loop, an asynchronous checkpoint's write: it holds no step up), `offload` spans (an
-- optimizer offload's copies and host updates beside the loop, and its waits, inside a
-- forward that holds them) and device
-- communication kernels (the collective rows stand for them). Collectives: every finished row;
-- its arrival (t0): the posting time for send/recv; for a host-timed collective, when the rank
-- waited for it (start_ns: the call, or the wait() of an async one), so that the wait lands
-- inside the span that holds it and cuts it (an async collective posted during the backward and
-- waited for at the optimizer's start must not leave that wait inside the optimizer's compute);
-- else the device start.
-- cls: 0 compute (any span), 1 collective, 2 send, 3 recv
-- tie: a rank's order among operations of one start time: sends and receives first (posted
-- beside the span that starts with them), then spans, then collectives (which a span that
-- starts with them holds, as a sequence-parallel all_gather opening a forward)
select
    rank,
    step,
    0::tinyint as cls,
    1::tinyint as tie,
    name as label,
    '' as grp,
    0::bigint as seq,
    -1 as peer,
    0::bigint as nbytes,
    start_ns as t0,
    end_ns as t1
from spans
where name not in ('step', 'recompute') and kind not in ('comm', 'background', 'offload')
    and end_ns is not null and step >= 0
union all
select
    rank,
    step,
    (case op when 'send' then 2 when 'recv' then 3 else 1 end)::tinyint as cls,
    (case when op in ('send', 'recv') then 0 else 2 end)::tinyint as tie,
    op as label,
    "group" as grp,
    seq,
    peer,
    coalesce(nbytes, 0) as nbytes,
    case
        when op in ('send', 'recv') then issue_ns
        else coalesce(start_ns, issue_ns)
    end as t0,
    end_ns as t1
from collectives
where end_ns is not null and step >= 0
