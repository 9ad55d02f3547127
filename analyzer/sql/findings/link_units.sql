-- link_units: per unit (a process group, or the two ends of send/recv transfers), its
-- transfers in steps [$lo, $hi] compared with the same transfers elsewhere.
-- columns: group, unit_a, unit_b, op, ops, n, ratio, late_frac, peers, busbw,
--          excess_ns_per_step, steps, sigma
--   op, ops         one of the unit's ops, and all of them ('/'-separated, sorted)
--   transfer        the end of a complete instance minus its LAST member's arrival (waiting for
--                   a late member is not transfer); per byte for send/recv
--   unit_a, unit_b  (gid, -1) for a group; (lower rank, higher rank) for a send/recv pair
--   ratio           median of transfer / reference, the reference being the median of the same
--                   collective in the OTHER groups of that kind (the same op of the same size at
--                   the same place among those in the step: groups of one kind on different
--                   pipeline stages run different sequences, the last stage's tp group the loss's
--                   collectives too, so a sequence number names different collectives there), or
--                   of the same seq between the same two pipeline stages per byte on the other
--                   links; only among units that span as many hosts (a group across two hosts
--                   runs over the network, its peers within one host over NVLink: slower, and
--                   no fault)
--   n, peers        transfers compared, and the median number of comparable transfers each
--   steps           steps with transfers compared
--   late_frac       share of its transfers with ratio >= $late
--   excess_ns_per_step  median over steps of the summed (transfer - transfer / ratio)
--   sigma           the noise of the group kind: 1.4826 x the median absolute deviation of all
--                   its transfers' ratios
with

-- a group's collective's place: its rank among the group's collectives of the same op and size
-- in the step, numbered before unfinished ones are left out so that one lost row does not move
-- the others; a send/recv's place is its seq (pairs between the same two stages run the same
-- sequence)
placed_in_step as (
    select
        *,
        case
            when src >= 0 then seq
            else row_number() over (partition by "group", gid, step, op, nbytes order by seq)
        end as place
    from collective_instances
    where step between $lo and $hi
),

-- how many hosts a group spans (an unknown host counts as one)
group_hosts as (
    select m."group", m.gid, count(distinct coalesce(c.host, '')) as hosts
    from group_members as m
    left join rank_coords as c on c.rank = m.rank
    group by m."group", m.gid
),

done as (
    select
        i.*,
        ks.pp as src_pp,
        kd.pp as dst_pp,
        case
            when i.src >= 0
                then case when coalesce(ks.host, '') = coalesce(kd.host, '') then 1 else 2 end
            else coalesce(gh.hosts, 1)
        end as hosts
    from placed_in_step as i
    left join rank_coords as ks on ks.rank = i.src
    left join rank_coords as kd on kd.rank = i.dst
    left join group_hosts as gh on gh."group" = i."group" and gh.gid = i.gid and i.src < 0
    where i.unfinished = 0 and i.entered >= i.size and i.size >= 2 and i.transfer_ns > 0
),

costed as (
    select
        "group",
        case when src >= 0 then least(src, dst) else gid end as unit_a,
        case when src >= 0 then greatest(src, dst) else -1 end as unit_b,
        case when src >= 0 then 'p2p' else op end as class_op,
        case when src >= 0 then src_pp else -1 end as class_src,
        case when src >= 0 then dst_pp else -1 end as class_dst,
        case when src >= 0 then -1 else nbytes end as class_bytes,
        case when src >= 0 then -1 else step end as class_step,
        hosts as class_hosts,
        place,
        op,
        step,
        transfer_ns,
        busbw_gbps,
        case when src >= 0 then transfer_ns / greatest(nbytes, 1) else transfer_ns end as cost
    from done
),

-- each transfer's place k (1-based) among the n of its class, sorted by cost
placed as (
    select
        *,
        row_number() over (c order by cost) as k,
        count(*) over c as class_n
    from costed
    window c as (
        partition by
            "group", class_op, class_src, class_dst, class_bytes, class_step, class_hosts, place
    )
),

-- the three order statistics around the middle that the median of the others needs:
-- lo, mid, hi = the (h)th, (h+1)th and (h+2)th smallest, h = (n - 1) // 2
middles as (
    select
        *,
        max(case when k = (class_n - 1) // 2 then cost end) over c as lo,
        max(case when k = (class_n - 1) // 2 + 1 then cost end) over c as mid,
        max(case when k = (class_n - 1) // 2 + 2 then cost end) over c as hi
    from placed
    window c as (
        partition by
            "group", class_op, class_src, class_dst, class_bytes, class_step, class_hosts, place
    )
),

-- the median of the OTHER transfers of the class (the transfer itself left out: with four
-- links, a median that took the slow one in would be the mean of the two slower others)
ratios as (
    select
        *,
        cost / (
            case
                when class_n % 2 = 0  -- an odd number of others: the (n/2)th of them
                    then case when class_n // 2 < k then mid else hi end
                else (  -- an even number: the mean of the hth and (h+1)th of them
                    (case when (class_n - 1) // 2 < k then lo else mid end)
                    + (case when (class_n - 1) // 2 + 1 < k then mid else hi end)
                ) / 2
            end
        ) as ratio
    from middles
    where class_n >= 2
),

excess as (
    select *, greatest(transfer_ns * (1 - 1 / ratio), 0) as excess_ns
    from ratios
    where ratio > 0
),

per_step as (
    select
        "group",
        unit_a,
        unit_b,
        step,
        sum(excess_ns) as excess_ns
    from excess
    group by "group", unit_a, unit_b, step
),

per_unit as (
    select
        "group",
        unit_a,
        unit_b,
        any_value(op) as op,
        array_to_string(list_sort(list_distinct(list(op))), '/') as ops,
        count(*) as n,
        median(ratio) as ratio,
        avg(case when ratio >= $late then 1.0 else 0.0 end) as late_frac,
        median(class_n - 1) as peers,
        median(busbw_gbps) as busbw
    from excess
    group by "group", unit_a, unit_b
),

kind_median as (
    select "group", median(ratio) as m from excess group by "group"
),

noise as (
    select e."group", 1.4826 * median(abs(e.ratio - k.m)) as sigma
    from excess as e
    join kind_median as k using ("group")
    group by e."group"
),

final as (
    select u.*, s.excess_ns_per_step, s.steps, z.sigma
    from per_unit as u
    join noise as z using ("group")
    join (
        select
            "group",
            unit_a,
            unit_b,
            median(excess_ns) as excess_ns_per_step,
            count(*) as steps
        from per_step
        group by "group", unit_a, unit_b
    ) as s using ("group", unit_a, unit_b)
)

select * from final
