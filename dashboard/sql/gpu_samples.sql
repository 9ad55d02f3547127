-- the dashboard's copy of the NVML samples (small: one per rank every few steps), so that a
-- per-rank reading over a step range does not scan every rank's files again
-- columns: rank, ts_ns, sm_clock_mhz, power_w, temp_c, util_gpu
with
final as (
    select rank, ts_ns, sm_clock_mhz, power_w, temp_c, util_gpu from gpu
)
select * from final
