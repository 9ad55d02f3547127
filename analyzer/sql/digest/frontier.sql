-- digest_frontier (table, made on demand): where each rank stopped in each channel (see
-- digest/collectives.sql for channels), over the whole run.
-- columns: rank, group, peer, is_send, group_size, last_seq, last_op, last_step, open_seq,
--          done_seq, last_ts_ns
--   open_seq    highest seq with a row left unfinished (end_ns null); done_seq: highest seq
--               finished (a row flushed unfinished, then finished, has both)
--   last_ts_ns  the latest time the rank was seen in the channel (an end, else the call)
with

final as (
    select
        rank,
        "group",
        peer,
        op = 'send' as is_send,
        max(group_size) as group_size,
        max(seq) as last_seq,
        arg_max(op, seq) as last_op,
        arg_max(step, seq) as last_step,
        max(seq) filter (where end_ns is null) as open_seq,
        max(seq) filter (where end_ns is not null) as done_seq,
        max(coalesce(end_ns, issue_ns)) as last_ts_ns
    from collectives
    group by rank, "group", peer, is_send
)

select * from final
