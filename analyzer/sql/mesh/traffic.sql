-- mesh/traffic: who talks to whom, on which group, and whether inside a forward: what an
-- attached script's process groups tell of its mesh (analyzer/meshinfer.py), in steps $lo to
-- $hi: sends, receives and reductions only (what the reading uses)
-- columns: rank, group, peer, op, n, n_forward
--   peer       the send's or recv's peer (global rank); -1 for a group collective
--   n_forward  of the n calls, those issued inside one of the rank's `forward` spans
with

calls as (
    select
        row_number() over () as id,
        rank,
        coalesce("group", '') as "group",
        case when op in ('send', 'recv') then coalesce(peer, -1) else -1 end as peer,
        op,
        issue_ns
    from collectives
    where step between $lo and $hi
        and op in ('send', 'recv', 'all_reduce', 'reduce_scatter')
),

inside as (
    select distinct c.id
    from calls as c
    inner join spans as f
        on f.rank = c.rank and f.name = 'forward' and f.step between $lo and $hi
        and c.issue_ns >= f.start_ns and c.issue_ns <= f.end_ns
),

final as (
    select
        c.rank,
        c."group",
        c.peer,
        c.op,
        count(*) as n,
        count(i.id) as n_forward
    from calls as c
    left join inside as i on i.id = c.id
    group by all
)

select * from final order by rank, "group", peer, op
