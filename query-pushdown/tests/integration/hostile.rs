//! Malformed and hostile fragments get INVALID_ARGUMENT with a reason, never a panic
//! or a stack overflow, and the node keeps answering correctly afterwards.

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use csd_protocol::Compression;
use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::wire::fragment::{Mode, OPERATOR_NAME, SqlFragment};
use csd_query_pushdown::wire::keyfilter::{Bloom, KeyFilterMsg, hash_rows};
use datafusion::prelude::SessionContext;
use datafusion_substrait::logical_plan::producer::to_substrait_plan;
use datafusion_substrait::substrait::proto::{
    self, Expression, FunctionArgument, Plan, ReadRel, Rel, expression, function_argument,
    plan_rel, read_rel, rel,
};
use futures::TryStreamExt;
use prost::Message;
use tonic::Code;

use crate::{nodes, register_local};

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
    ]))
}

fn data() -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..1000)),
            Arc::new(StringArray::from_iter_values(
                (0..1000).map(|i| format!("s{i}")),
            )),
        ],
    )
    .unwrap()
}

async fn plan_of(sql: &str) -> Plan {
    let ctx = SessionContext::new();
    register_local(&ctx, "t", schema(), vec![data()]);
    let p = ctx.sql(sql).await.unwrap().into_optimized_plan().unwrap();
    *to_substrait_plan(&p, &ctx.state()).unwrap()
}

fn fragment(plan: &Plan, mode: Mode) -> Vec<u8> {
    SqlFragment {
        table: "t".into(),
        partition: None,
        plan: plan.encode_to_vec(),
        mode: mode as i32,
        ..Default::default()
    }
    .to_bytes()
}

/// Sends `args`; returns the status code and message of the failure.
async fn refused(c: &NodeClient, args: Vec<u8>) -> (Code, String) {
    let r = match c.operator(OPERATOR_NAME, args, Compression::None).await {
        Err(e) => Err(e),
        Ok(reply) => reply.batches.try_collect::<Vec<_>>().await.map(|_| ()),
    };
    match r {
        Err(csd_protocol::node_client::Error::Rpc { code, message }) => (code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn rows(c: &NodeClient, args: Vec<u8>) -> usize {
    let reply = c
        .operator(OPERATOR_NAME, args, Compression::Zstd)
        .await
        .unwrap();
    let b: Vec<RecordBatch> = reply.batches.try_collect().await.unwrap();
    b.iter().map(RecordBatch::num_rows).sum()
}

fn root(plan: &mut Plan) -> &mut Rel {
    match plan.relations[0].rel_type.as_mut().unwrap() {
        plan_rel::RelType::Root(r) => r.input.as_mut().unwrap(),
        plan_rel::RelType::Rel(r) => r,
    }
}

fn read_of(r: &mut Rel) -> &mut ReadRel {
    match r.rel_type.as_mut().unwrap() {
        rel::RelType::Read(r) => r,
        rel::RelType::Project(p) => read_of(p.input.as_mut().unwrap()),
        rel::RelType::Filter(f) => read_of(f.input.as_mut().unwrap()),
        rel::RelType::Fetch(f) => read_of(f.input.as_mut().unwrap()),
        rel::RelType::Aggregate(a) => read_of(a.input.as_mut().unwrap()),
        rel::RelType::Sort(s) => read_of(s.input.as_mut().unwrap()),
        other => panic!("unexpected {other:?}"),
    }
}

/// The filter condition of the plan (a `FilterRel` or the read's own filter).
fn condition(r: &mut Rel) -> &mut Option<Box<Expression>> {
    match r.rel_type.as_mut().unwrap() {
        rel::RelType::Filter(f) => &mut f.condition,
        rel::RelType::Read(r) => &mut r.filter,
        rel::RelType::Project(p) => condition(p.input.as_mut().unwrap()),
        rel::RelType::Fetch(f) => condition(f.input.as_mut().unwrap()),
        rel::RelType::Sort(s) => condition(s.input.as_mut().unwrap()),
        rel::RelType::Aggregate(a) => condition(a.input.as_mut().unwrap()),
        other => panic!("unexpected {other:?}"),
    }
}

fn lit(i: i64) -> Expression {
    Expression {
        rex_type: Some(expression::RexType::Literal(expression::Literal {
            literal_type: Some(expression::literal::LiteralType::I64(i)),
            ..Default::default()
        })),
    }
}

fn call(anchor: u32, args: Vec<Expression>) -> Expression {
    Expression {
        rex_type: Some(expression::RexType::ScalarFunction(
            expression::ScalarFunction {
                function_reference: anchor,
                arguments: args
                    .into_iter()
                    .map(|e| FunctionArgument {
                        arg_type: Some(function_argument::ArgType::Value(e)),
                    })
                    .collect(),
                ..Default::default()
            },
        )),
    }
}

/// Runs `f` on a thread with a big stack (deeply nested protobuf values recurse when
/// built, encoded and dropped — in this test, never in the node).
fn big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_fragments_are_refused() {
    let (_nodes, clients) = nodes(1).await;
    let c = &clients[0];
    c.put("t", "p0", schema(), futures::stream::iter(vec![Ok(data())]))
        .await
        .unwrap();
    let good = plan_of("select a, s from t where a > 900").await;
    assert_eq!(rows(c, fragment(&good, Mode::Complete)).await, 99);

    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    // Truncated bytes, at every length.
    let whole = fragment(&good, Mode::Complete);
    for cut in [0, 1, 2, 5, whole.len() / 2, whole.len() - 1] {
        cases.push(("truncated fragment", whole[..cut].to_vec(), ""));
    }
    let mut bytes = good.encode_to_vec();
    bytes.truncate(bytes.len() - 3);
    cases.push((
        "truncated plan",
        SqlFragment {
            table: "t".into(),
            partition: None,
            plan: bytes,
            mode: 0,
            ..Default::default()
        }
        .to_bytes(),
        "Substrait",
    ));
    cases.push(("garbage", vec![0xff; 64], "malformed"));

    // 10,000-deep nesting: `a > 900` wrapped in 10,000 `not`s.
    let deep = {
        let mut p = good.clone();
        let not_anchor = 4242;
        p.extensions
            .push(proto::extensions::SimpleExtensionDeclaration {
                mapping_type: Some(
                    proto::extensions::simple_extension_declaration::MappingType::ExtensionFunction(
                        proto::extensions::simple_extension_declaration::ExtensionFunction {
                            function_anchor: not_anchor,
                            name: "not:bool".into(),
                            ..Default::default()
                        },
                    ),
                ),
            });
        big_stack(move || {
            let c = condition(root(&mut p));
            let mut e = c.take().map(|b| *b).unwrap();
            for _ in 0..10_000 {
                e = call(not_anchor, vec![e]);
            }
            *c = Some(Box::new(e));
            fragment(&p, Mode::Complete)
        })
    };
    cases.push(("10,000-deep expression", deep, "recursion limit"));

    // 28-deep: decodes, but is over the expression-depth limit.
    let mut p = good.clone();
    {
        let c = condition(root(&mut p));
        let mut e = c.take().map(|b| *b).unwrap();
        for _ in 0..28 {
            e = call(0, vec![e, lit(1)]);
        }
        *c = Some(Box::new(e));
    }
    cases.push((
        "28-deep expression",
        fragment(&p, Mode::Complete),
        "deeper than",
    ));

    // A million-element IN list (too big for a ticket), and 20,000 (over the limit).
    for n in [1_000_000usize, 20_000] {
        let mut p = good.clone();
        *condition(root(&mut p)) = Some(Box::new(Expression {
            rex_type: Some(expression::RexType::SingularOrList(Box::new(
                expression::SingularOrList {
                    value: Some(Box::new(lit(0))),
                    options: (0..n as i64).map(lit).collect(),
                },
            ))),
        }));
        let why = if n > 100_000 { "exceeds" } else { "IN list" };
        cases.push(("huge IN list", fragment(&p, Mode::Complete), why));
    }

    // Unknown and volatile functions: UNIMPLEMENTED, which the compute tier takes as
    // "evaluate it yourself".
    let mut unimplemented = Vec::new();
    for (name, why) in [
        ("no_such_function:i64", "cannot run"),
        ("random", "cannot run"),
    ] {
        let mut p = good.clone();
        if let Some(
            proto::extensions::simple_extension_declaration::MappingType::ExtensionFunction(f),
        ) = p.extensions[0].mapping_type.as_mut()
        {
            f.name = name.into();
        }
        unimplemented.push((name, fragment(&p, Mode::Complete), why));
    }

    // Wrong types: an integer column as the filter condition.
    let mut p = plan_of("select a from t where a + 1 > 2 and a > 3").await;
    {
        *condition(root(&mut p)) = Some(Box::new(Expression {
            rex_type: Some(expression::RexType::Selection(Box::new(
                expression::FieldReference {
                    reference_type: Some(
                        expression::field_reference::ReferenceType::DirectReference(
                            expression::ReferenceSegment {
                                reference_type: Some(
                                    expression::reference_segment::ReferenceType::StructField(
                                        Box::new(expression::reference_segment::StructField {
                                            field: 0,
                                            child: None,
                                        }),
                                    ),
                                ),
                            },
                        ),
                    ),
                    root_type: Some(expression::field_reference::RootType::RootReference(
                        expression::field_reference::RootReference {},
                    )),
                },
            ))),
        }));
    }
    cases.push(("non-boolean filter", fragment(&p, Mode::Complete), ""));
    // A column that does not exist (DataFusion's consumer would index out of bounds).
    let mut q = p.clone();
    if let Some(e) = condition(root(&mut q)).as_mut()
        && let Some(expression::RexType::Selection(f)) = e.rex_type.as_mut()
        && let Some(expression::field_reference::ReferenceType::DirectReference(seg)) =
            f.reference_type.as_mut()
        && let Some(expression::reference_segment::ReferenceType::StructField(sf)) =
            seg.reference_type.as_mut()
    {
        sf.field = 7;
    }
    cases.push((
        "column out of range",
        fragment(&q, Mode::Complete),
        "out of range",
    ));

    // Reading local files, another table, or joining.
    let mut p = good.clone();
    read_of(root(&mut p)).read_type = Some(read_rel::ReadType::LocalFiles(read_rel::LocalFiles {
        items: vec![read_rel::local_files::FileOrFiles {
            path_type: Some(read_rel::local_files::file_or_files::PathType::UriFile(
                "file:///etc/passwd".into(),
            )),
            ..Default::default()
        }],
        advanced_extension: None,
    }));
    cases.push(("local files", fragment(&p, Mode::Complete), "named-table"));
    let mut p = good.clone();
    read_of(root(&mut p)).read_type = Some(read_rel::ReadType::NamedTable(read_rel::NamedTable {
        names: vec!["secret".into()],
        advanced_extension: None,
    }));
    cases.push(("other table", fragment(&p, Mode::Complete), "may read only"));
    let mut p = good.clone();
    let input = root(&mut p).clone();
    *root(&mut p) = Rel {
        rel_type: Some(rel::RelType::Cross(Box::new(proto::CrossRel {
            left: Some(Box::new(input.clone())),
            right: Some(Box::new(input)),
            ..Default::default()
        }))),
    };
    cases.push(("cross join", fragment(&p, Mode::Complete), "not allowed"));

    // Partial aggregation of something that is not an aggregate.
    cases.push((
        "partial non-aggregate",
        fragment(&good, Mode::PartialAggregate),
        "aggregate",
    ));

    // Join-key filters that do not fit the fragment's output.
    let with_filter = |f: KeyFilterMsg, direct_above: Option<f32>| {
        SqlFragment {
            table: "t".into(),
            partition: None,
            plan: good.encode_to_vec(),
            mode: 0,
            key_filters: vec![f],
            direct_above,
            objects: vec![],
            functions: vec![],
            partitions: vec![],
            shrink_above: None,
            output_schema: vec![],
            late_filters: false,
            state_bytes: None,
        }
        .to_bytes()
    };
    // Several partitions read as one: named with a single partition too, twice, or
    // one the node does not hold.
    let over = |partition: Option<&str>, partitions: &[&str]| {
        SqlFragment {
            table: "t".into(),
            partition: partition.map(Into::into),
            plan: good.encode_to_vec(),
            partitions: partitions.iter().map(|p| p.to_string()).collect(),
            ..Default::default()
        }
        .to_bytes()
    };
    cases.push((
        "partition and partitions",
        over(Some("p0"), &["p0", "p1"]),
        "one or the other",
    ));
    cases.push(("a partition twice", over(None, &["p0", "p0"]), "twice"));
    let lacking = over(None, &["no_such_partition"]);
    let keys = Bloom::with_keys(&[1, 2, 3]).unwrap();
    cases.push((
        "key filter column",
        with_filter(keys.to_msg(&[7]), None),
        "column 7",
    ));
    let mut short = keys.to_msg(&[0]);
    short.blocks.truncate(12);
    cases.push((
        "key filter bits",
        with_filter(short, None),
        "32-byte blocks",
    ));
    let mut old = keys.to_msg(&[0]);
    old.blocks.clear();
    cases.push((
        "key filter of an earlier build",
        with_filter(old, None),
        "earlier build",
    ));
    cases.push((
        "direct_above",
        with_filter(keys.to_msg(&[0]), Some(7.0)),
        "fraction",
    ));
    let mut both = keys.to_msg(&[0]);
    both.attachment = Some(vec![7; 32]);
    cases.push((
        "key filter with blocks and an attachment",
        with_filter(both, None),
        "one or the other",
    ));
    let mut bad_digest = keys.to_msg(&[0]);
    bad_digest.blocks.clear();
    bad_digest.attachment = Some(vec![7; 5]);
    cases.push((
        "key filter attachment digest",
        with_filter(bad_digest, None),
        "32 bytes",
    ));

    for (what, args, why) in cases {
        let (code, msg) = refused(c, args).await;
        assert_eq!(code, Code::InvalidArgument, "{what}: {msg}");
        assert!(msg.contains(why), "{what}: {msg:?} should mention {why:?}");
    }
    for (what, args, why) in unimplemented {
        let (code, msg) = refused(c, args).await;
        assert_eq!(code, Code::Unimplemented, "{what}: {msg}");
        assert!(msg.contains(why), "{what}: {msg:?} should mention {why:?}");
    }
    let (code, msg) = refused(c, lacking).await;
    assert_eq!(code, Code::NotFound, "{msg}");
    assert!(msg.contains("no_such_partition"), "{msg}");
    // An operator the node does not have.
    let e = c
        .operator("nope", vec![], Compression::None)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");

    // The node is fine afterwards.
    assert_eq!(rows(c, fragment(&good, Mode::Complete)).await, 99);
    // A well-formed key filter keeps exactly the keys it holds (and bloom false
    // positives, which among 99 rows and 3 keys there are none of at this size).
    let hashes = |v: &[i64]| {
        let col: arrow::array::ArrayRef = Arc::new(Int64Array::from(v.to_vec()));
        hash_rows(&[col], v.len()).unwrap().0
    };
    let keep = Bloom::with_keys(&hashes(&[901, 950, 5])).unwrap();
    assert_eq!(rows(c, with_filter(keep.to_msg(&[0]), None)).await, 2);
    // The same filter by attachment: refused naming it until sent, then the same rows.
    let blocks = keep.to_msg(&[0]).blocks;
    let digest = csd_protocol::ModuleDigest::of(&blocks);
    let by_ref = || with_filter(keep.to_msg(&[0]).by_attachment(&digest), None);
    let e = c
        .operator(OPERATOR_NAME, by_ref(), Compression::None)
        .await
        .err()
        .expect("a filter the node was never sent is refused");
    assert!(
        matches!(e, csd_protocol::node_client::Error::AttachmentMissing(d) if d == digest),
        "{e:?}"
    );
    let put = c.put_attachment(&blocks).await.unwrap();
    assert_eq!(put.digest, digest.to_string());
    assert_eq!(rows(c, by_ref()).await, 2);
    assert_eq!(rows(c, by_ref()).await, 2);
    let a = c.stats().await.unwrap().attachments;
    assert_eq!(
        (a.kept, a.received, a.used, a.missing),
        (1, 1, 2, 1),
        "{a:?}"
    );
    let agg = plan_of("select s, count(*), avg(a) from t where a < 10 group by s").await;
    assert_eq!(rows(c, fragment(&agg, Mode::Complete)).await, 10);
    assert!(rows(c, fragment(&agg, Mode::PartialAggregate)).await >= 10);
}

/// The seeds' directory, read at run time: a test binary cached in a shared target
/// directory may have been built from a checkout at another path.
fn seeds() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("fuzz/seeds/fragment_decode")
}

/// Writes the fuzz seeds (real fragments): `cargo test -p csd-query-pushdown --test
/// integration write_fuzz_seeds -- --ignored`.
#[tokio::test]
#[ignore]
async fn write_fuzz_seeds() {
    std::fs::create_dir_all(seeds()).unwrap();
    for (name, sql, mode) in [
        (
            "scan",
            "select a, s from t where a > 900 and s like 's1%'",
            Mode::Complete,
        ),
        (
            "topk",
            "select a from t where a in (1, 2, 3) order by a desc limit 2",
            Mode::Complete,
        ),
        (
            "agg",
            "select s, count(*), avg(a) from t where a < 10 group by s",
            Mode::PartialAggregate,
        ),
        (
            "case",
            "select case when a > 5 then upper(s) else s end from t where a between 1 and 9",
            Mode::Complete,
        ),
    ] {
        std::fs::write(seeds().join(name), fragment(&plan_of(sql).await, mode)).unwrap();
    }
    // A direct scan with a join-key filter on its first column.
    let keyed = SqlFragment {
        table: "t".into(),
        partition: None,
        plan: plan_of("select a, s from t").await.encode_to_vec(),
        mode: 0,
        key_filters: vec![Bloom::with_keys(&[1, 2, 3]).unwrap().to_msg(&[0])],
        direct_above: Some(0.3),
        objects: vec![],
        functions: vec![],
        partitions: vec![],
        shrink_above: None,
        output_schema: vec![],
        late_filters: false,
        state_bytes: None,
    };
    std::fs::write(seeds().join("keyfilter"), keyed.to_bytes()).unwrap();
}

/// The checked-in seeds are valid fragments (so the fuzzer starts from real plans).
#[test]
fn fuzz_seeds_are_valid_fragments() {
    let mut n = 0;
    for e in std::fs::read_dir(seeds()).unwrap() {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        let c = SqlFragment::decode_checked(&bytes).unwrap();
        csd_query_pushdown::wire::fragment::validate(&c.plan, &c.frag.table, &|_| true).unwrap();
        n += 1;
    }
    assert!(n >= 5);
}

/// A fragment that says it holds more state than the node's whole memory budget
/// (a part run whole, by the asker's sketches) is handed back before it runs, not
/// run into a spill; one that fits runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_past_the_budget_is_handed_back() {
    let (_nodes, clients) = nodes(1).await;
    let c = &clients[0];
    c.put("t", "p0", schema(), futures::stream::iter(vec![Ok(data())]))
        .await
        .unwrap();
    let plan = plan_of("select s, count(*) from t group by s").await;
    let holding = |bytes: u64| {
        SqlFragment {
            table: "t".into(),
            plan: plan.encode_to_vec(),
            mode: Mode::Complete as i32,
            state_bytes: Some(bytes),
            ..Default::default()
        }
        .to_bytes()
    };
    assert_eq!(rows(c, holding(1 << 20)).await, 1000);
    let handed_back = |bytes: u64| async move {
        let answer = match c
            .operator(OPERATOR_NAME, holding(bytes), Compression::None)
            .await
        {
            Ok(reply) => reply.batches.try_collect::<Vec<_>>().await.map(|_| ()),
            Err(e) => Err(e),
        };
        match answer.unwrap_err() {
            csd_protocol::node_client::Error::PushedBack(p) => p.reason,
            e => panic!("{bytes} bytes of state: {e:?}"),
        }
    };
    let why = handed_back(1 << 50).await;
    assert!(why.contains("more than the node's whole budget"), "{why}");
    // The largest claim the wire carries: handed back too, not added past u64.
    let why = handed_back(u64::MAX).await;
    assert!(why.contains("more than the node's whole budget"), "{why}");
    assert_eq!(rows(c, holding(1 << 20)).await, 1000, "the node serves on");
}
