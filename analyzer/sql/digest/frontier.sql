-- digest_frontier (table, made on demand): where each rank stopped in each channel (see
-- digest/collectives.sql for channels), over the whole run. One scan of collectives.
-- columns: rank, group, peer, is_send, group_size, last_seq, last_op, last_step, open_seq,
--          done_seq, min_seq, last_ts_ns, last_issue_ns, open_rows
--   open_seq    highest seq with a row left unfinished (end_ns null); done_seq: highest seq
--               finished (a row flushed unfinished, then finished, has both)
--   min_seq     lowest seq recorded (a ring buffer or a resumed run starts above the first)
--   last_ts_ns  the latest time the rank was seen in the channel (an end, else the call)
--   last_issue_ns  the latest call in the channel
--   open_rows   the unfinished rows above done_seq (list of {seq, op, step, issue_ns,
--               started}, by seq; a row flushed twice unfinished appears twice); started: a
--               device start after the call is known (NCCL with timing: the kernel ran)
with

per_channel as (
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
        min(seq) as min_seq,
        max(coalesce(end_ns, issue_ns)) as last_ts_ns,
        max(issue_ns) as last_issue_ns,
        list({'seq': seq, 'op': op, 'step': step, 'issue_ns': issue_ns,
              'started': start_ns > issue_ns} order by seq)
            filter (where end_ns is null) as open_all
    from collectives
    group by rank, "group", peer, is_send
),

final as (
    select
        * exclude (open_all),
        coalesce(
            list_filter(open_all, lambda x: x.seq > coalesce(done_seq, -9223372036854775807)), []
        ) as open_rows
    from per_channel
)

select * from final
