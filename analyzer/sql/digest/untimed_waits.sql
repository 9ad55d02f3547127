-- untimed_waits (table, made at open only for a run with `untimed` collectives: rows whose
-- completion is known but not its time, as gloo's collectives read from Flight Recorder are):
-- when each such collective could have ended, and from when its rank was waiting in it.
-- columns: rank, group, seq, end_ns, wait_from_ns
--   end_ns        the last member's arrival: a collective ends on no member before everyone
--                 is in (the transfer after that is unknown and left out)
--   wait_from_ns  where the rank's wait began: its own latest arrival at any collective up to
--                 end_ns (a rank that issued more collectives meanwhile was still working, as
--                 DDP is while its early buckets reduce), and not before the end of an earlier
--                 wait (overlapping waits count once); its wait is end_ns - wait_from_ns
with

untimed as (
    select
        c.rank,
        c."group",
        c.seq,
        c.issue_ns,
        coalesce(m.gid, 0) as gid
    from collectives as c
    left join group_members as m on m."group" = c."group" and m.rank = c.rank
    where c.source = 'untimed' and c.end_ns is not null and c.op not in ('send', 'recv')
),

ends as (
    select
        "group",
        gid,
        seq,
        max(issue_ns) as end_ns
    from untimed
    group by "group", gid, seq
),

estimated as (
    select
        u.rank,
        u."group",
        u.seq,
        u.issue_ns,
        e.end_ns
    from untimed as u
    inner join ends as e on e."group" = u."group" and e.gid = u.gid and e.seq = u.seq
),

arrivals as (
    select
        rank,
        issue_ns as arrival_ns
    from collectives
),

latest as (
    select
        est.*,
        a.arrival_ns as latest_ns
    from estimated as est
    asof left join arrivals as a on a.rank = est.rank and a.arrival_ns <= est.end_ns
),

ordered as (
    select
        *,
        max(end_ns) over (
            partition by rank order by end_ns, seq
            rows between unbounded preceding and 1 preceding
        ) as earlier_end_ns
    from latest
),

final as (
    select
        rank,
        "group",
        seq,
        end_ns,
        least(
            end_ns, greatest(issue_ns, coalesce(latest_ns, issue_ns), coalesce(earlier_end_ns, 0))
        ) as wait_from_ns
    from ordered
)

select * from final
