-- the spans of ranks $ranks in step $step (the enclosing `step` span left out)
-- columns: rank, microbatch, name, kind, start_ns, end_ns, nbytes, direction, stream
--   nbytes, direction, stream  an offload span's transfer (null on other spans)
with
final as (
    select rank, microbatch, name, kind, start_ns, end_ns, nbytes, direction, stream
    from spans
    where step = $step and list_contains($ranks, rank) and name <> 'step'
    order by rank, start_ns
)
select * from final
