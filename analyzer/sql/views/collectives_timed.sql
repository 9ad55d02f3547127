-- collectives_timed (view): the collectives, with the end of each `untimed` row estimated
-- (digest/untimed_waits.sql) and the time its wait began; what the digests and
-- collective_rows read. Timed rows pass unchanged, with a null wait_from_ns.
select
    c.* replace (coalesce(w.end_ns, c.end_ns) as end_ns),
    w.wait_from_ns
from collectives as c
left join untimed_waits as w
    on
        c.source = 'untimed'
        and w.rank = c.rank
        and w."group" = c."group"
        and w.seq = c.seq
        and c.op not in ('send', 'recv')
