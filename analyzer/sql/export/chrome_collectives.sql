-- chrome_collectives: collectives in the order the exporter deals them into lanes.
-- output columns: rank, step, op, group, group_size, seq, peer, nbytes, dtype, issue_ns,
--   start_ns, end_ns
with final as (
    select
        rank, step, op, "group", group_size, seq, peer, nbytes, dtype, issue_ns, start_ns, end_ns
    from collectives
    where start_ns is not null
    order by rank, start_ns, seq
)

select * from final
