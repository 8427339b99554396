//! Where the copies of a partition go: rendezvous (highest-random-weight) hashing
//! of `table/partition` over the nodes given, so that the same nodes in any order
//! place a partition the same way, partitions spread evenly, and adding a node
//! moves only the copies it wins.

/// The `copies` nodes of `nodes` that hold `table`/`partition`, best first; an
/// error when there are fewer nodes than copies.
pub fn nodes_for<'a>(
    table: &str,
    partition: &str,
    nodes: &'a [String],
    copies: usize,
) -> Result<Vec<&'a String>, String> {
    let mut distinct: Vec<&String> = nodes.iter().collect();
    distinct.sort();
    distinct.dedup();
    if copies == 0 || copies > distinct.len() {
        return Err(format!(
            "{copies} copies of a partition need as many different nodes; {} given",
            distinct.len()
        ));
    }
    let key = format!("{table}/{partition}");
    distinct.sort_by_key(|n| std::cmp::Reverse(weight(&key, n)));
    distinct.truncate(copies);
    Ok(distinct)
}

/// FNV-1a of `key`, then `node`, mixed (a hash stable across builds and
/// platforms, unlike the standard library's).
fn weight(key: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes().chain([0]).chain(node.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64's finaliser: FNV's low bits alone spread similar names poorly.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("grpc://10.0.0.{i}:50051")).collect()
    }

    #[test]
    fn copies_spread_evenly_and_ignore_the_nodes_order() {
        let three = nodes(3);
        let mut reversed = three.clone();
        reversed.reverse();
        let mut held = [0usize; 3];
        for p in 0..600 {
            let a = nodes_for("t", &format!("p{p}"), &three, 2).unwrap();
            assert_eq!(a, nodes_for("t", &format!("p{p}"), &reversed, 2).unwrap());
            assert_ne!(a[0], a[1]);
            for n in a {
                held[three.iter().position(|x| x == n).unwrap()] += 1;
            }
        }
        // 1,200 copies over 3 nodes: 400 each, give or take.
        assert!(held.iter().all(|h| (340..=460).contains(h)), "{held:?}");
    }

    #[test]
    fn a_new_node_moves_only_what_it_wins() {
        let (three, four) = (nodes(3), nodes(4));
        for p in 0..200 {
            let before = nodes_for("t", &format!("p{p}"), &three, 1).unwrap();
            let after = nodes_for("t", &format!("p{p}"), &four, 1).unwrap();
            assert!(after == before || after[0] == &four[3]);
        }
    }

    #[test]
    fn more_copies_than_nodes_is_refused() {
        let two = nodes(2);
        let e = nodes_for("t", "p", &two, 3).unwrap_err();
        assert!(e.contains("3 copies") && e.contains("2 given"), "{e}");
        let same = vec![two[0].clone(), two[0].clone()];
        assert!(nodes_for("t", "p", &same, 2).is_err());
    }
}
