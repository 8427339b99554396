//! Wasm SQL functions: a scalar function a tenant ships as a WebAssembly module
//! (the ABI's SQL functions, see `csd_sandbox`), registered on the compute
//! session and, through the fragments that call it, on the node's fragment sessions.
//! Both sides run the same module under the same sandbox, so a fragment the node
//! hands back gives the same answer here.

use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow::datatypes::{DataType, Field, Schema};
use csd_protocol::ModuleDigest;
use csd_sandbox::{CompiledModule, GuestInstance, Sandbox};
use datafusion::common::{DataFusionError, Result as DfResult, ScalarValue, exec_err, plan_err};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::prelude::SessionContext;

use crate::wire::shipped::{ShippedFunction, WasmFunctionMsg, check_function_name};

/// Most arguments of a Wasm SQL function.
pub(crate) const MAX_FUNCTION_ARGS: usize = 32;

/// Parses a function's signature text, `ARG, … -> RET` in Arrow's type names.
pub fn parse_signature(text: &str) -> Result<(Vec<DataType>, DataType), String> {
    let (args, ret) = text
        .rsplit_once("->")
        .ok_or_else(|| format!("signature {text:?} has no `->` before its return type"))?;
    let ty = |s: &str| {
        DataType::from_str(s.trim()).map_err(|e| format!("signature {text:?}: {:?}: {e}", s.trim()))
    };
    let mut types = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in args.char_indices() {
        match c {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                types.push(ty(&args[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !args[start..].trim().is_empty() {
        types.push(ty(&args[start..])?);
    } else if !types.is_empty() {
        return Err(format!("signature {text:?} has an empty argument type"));
    }
    if types.len() > MAX_FUNCTION_ARGS {
        return Err(format!(
            "signature {text:?} has {} arguments; at most {MAX_FUNCTION_ARGS}",
            types.len()
        ));
    }
    Ok((types, ty(ret)?))
}

/// A Wasm SQL function as DataFusion calls it. Instances of its module are made on
/// first use and kept for the next batch (one per concurrent caller); they draw
/// memory from the sandbox's ledger until the function is dropped with the plan.
pub struct WasmScalarUdf {
    shipped: Arc<ShippedFunction>,
    args: Vec<DataType>,
    returns: DataType,
    signature: Signature,
    sandbox: Arc<Sandbox>,
    module: Arc<CompiledModule>,
    idle: Mutex<Vec<GuestInstance>>,
    cancel: Arc<AtomicBool>,
}

impl std::fmt::Debug for WasmScalarUdf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WasmScalarUdf({} = {:?}:{})",
            self.shipped.name, self.shipped.digest, self.shipped.export
        )
    }
}

impl PartialEq for WasmScalarUdf {
    fn eq(&self, other: &Self) -> bool {
        self.shipped.name == other.shipped.name
            && self.shipped.digest == other.shipped.digest
            && self.shipped.export == other.shipped.export
    }
}

impl Eq for WasmScalarUdf {}

impl Hash for WasmScalarUdf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.shipped.name.hash(state);
        self.shipped.digest.0.hash(state);
        self.shipped.export.hash(state);
    }
}

impl WasmScalarUdf {
    /// The function `shipped` of `module`, its signature read from the module; its
    /// calls stop once `cancel` is set.
    pub fn load(
        sandbox: Arc<Sandbox>,
        module: Arc<CompiledModule>,
        shipped: ShippedFunction,
        cancel: Arc<AtomicBool>,
    ) -> csd_protocol::Result<Self> {
        check_function_name(&shipped.name)?;
        let mut instance = sandbox.instantiate_functions(&module, cancel.clone())?;
        let text = instance.signature(&shipped.export)?;
        let (args, returns) = parse_signature(&text).map_err(|e| {
            csd_protocol::Error::InvalidArgument(format!(
                "wasm module {:?}, function {}: {e}",
                shipped.digest, shipped.export
            ))
        })?;
        Ok(WasmScalarUdf {
            shipped: Arc::new(shipped),
            args,
            returns,
            signature: Signature::user_defined(Volatility::Immutable),
            sandbox,
            module,
            idle: Mutex::new(vec![instance]),
            cancel,
        })
    }

    /// Calls the export on `batch`, in an idle instance or a new one (an instance
    /// whose call failed is dropped, not reused).
    fn call(&self, batch: &RecordBatch) -> csd_protocol::Result<ArrayRef> {
        let idle = self.idle.lock().ok().and_then(|mut v| v.pop());
        let mut instance = match idle {
            Some(i) => i,
            None => self
                .sandbox
                .instantiate_functions(&self.module, self.cancel.clone())?,
        };
        let out = instance.call_function(&self.shipped.export, batch)?;
        if let Ok(mut v) = self.idle.lock() {
            v.push(instance);
        }
        Ok(out)
    }
}

impl ScalarUDFImpl for WasmScalarUdf {
    fn name(&self) -> &str {
        &self.shipped.name
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    /// Arguments are cast to the module's declared types where Arrow can cast them.
    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        if arg_types.len() != self.args.len() {
            return plan_err!(
                "the Wasm SQL function {} takes {} arguments ({}), not {}",
                self.shipped.name,
                self.args.len(),
                self.args
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                arg_types.len()
            );
        }
        for (i, (have, want)) in arg_types.iter().zip(&self.args).enumerate() {
            if have != want && !arrow::compute::can_cast_types(have, want) {
                return plan_err!(
                    "argument {} of the Wasm SQL function {} is {have}, which does not cast to {want}",
                    i + 1,
                    self.shipped.name
                );
            }
        }
        Ok(self.args.clone())
    }

    fn return_type(&self, _arg_types: &[DataType]) -> DfResult<DataType> {
        Ok(self.returns.clone())
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let all_scalar = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let rows = if all_scalar && !args.args.is_empty() {
            1
        } else {
            args.number_rows
        };
        let mut columns = ColumnarValue::values_to_arrays(&args.args)?;
        for (c, want) in columns.iter_mut().zip(&self.args) {
            if c.data_type() != want {
                *c = arrow::compute::cast(c, want)?;
            }
        }
        let schema = Schema::new(
            self.args
                .iter()
                .enumerate()
                .map(|(i, t)| Field::new(format!("a{i}"), t.clone(), true))
                .collect::<Vec<_>>(),
        );
        let batch = RecordBatch::try_new_with_options(
            Arc::new(schema),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(rows)),
        )?;
        let out = self
            .call(&batch)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        if out.data_type() != &self.returns {
            return exec_err!(
                "the Wasm SQL function {} returned {} values; its signature says {}",
                self.shipped.name,
                out.data_type(),
                self.returns
            );
        }
        if all_scalar && args.number_rows != 1 {
            return Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?));
        }
        Ok(ColumnarValue::Array(out))
    }
}

/// Registers on `session` the Wasm SQL functions a fragment declares, checked with
/// it (`digests`: their modules', in order): each module from `sandbox` (its cache,
/// its device, or the bytes riding in the fragment; else the sandbox's `NOT_FOUND`
/// naming the digest). Returns their names.
pub(crate) async fn register_functions(
    session: &SessionContext,
    sandbox: &Arc<Sandbox>,
    functions: &[WasmFunctionMsg],
    digests: &[ModuleDigest],
    cancel: &Arc<AtomicBool>,
) -> csd_protocol::Result<Vec<String>> {
    let mut names = Vec::with_capacity(functions.len());
    for (f, digest) in functions.iter().zip(digests.iter().copied()) {
        let module = sandbox.module(&digest, f.module.as_deref()).await?;
        let udf = WasmScalarUdf::load(
            sandbox.clone(),
            module,
            ShippedFunction {
                name: f.name.clone(),
                export: f.export.clone(),
                digest,
                bytes: None,
            },
            cancel.clone(),
        )?;
        session.register_udf(ScalarUDF::new_from_impl(udf));
        names.push(f.name.clone());
    }
    Ok(names)
}

/// The Wasm SQL functions `plan` calls.
pub(crate) fn functions_in(
    plan: &datafusion::logical_expr::LogicalPlan,
) -> Vec<Arc<ShippedFunction>> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    use datafusion::logical_expr::Expr;
    let mut out: Vec<Arc<ShippedFunction>> = Vec::new();
    let _ = plan.apply(|p| {
        p.apply_expressions(|e| {
            e.apply(|x| {
                if let Expr::ScalarFunction(f) = x
                    && let Some(w) = f.func.inner().downcast_ref::<WasmScalarUdf>()
                    && !out.iter().any(|o| o.name == w.shipped.name)
                {
                    out.push(w.shipped.clone());
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    out
}

/// Whether `f` is a Wasm SQL function (pushable: the fragment carries its module).
pub(crate) fn is_wasm_function(f: &ScalarUDF) -> bool {
    f.inner().is::<WasmScalarUdf>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_parse_with_nested_types() {
        let (a, r) = parse_signature("Float64, Utf8 -> Int64").unwrap();
        assert_eq!(a, vec![DataType::Float64, DataType::Utf8]);
        assert_eq!(r, DataType::Int64);
        let (a, r) = parse_signature(" -> Boolean").unwrap();
        assert!(a.is_empty());
        assert_eq!(r, DataType::Boolean);
        let (a, _) = parse_signature("Decimal128(15, 2), Int32 -> Float64").unwrap();
        assert_eq!(a, vec![DataType::Decimal128(15, 2), DataType::Int32]);
        for bad in [
            "Float64",
            "Float64, -> Int64",
            "Flaot64 -> Int64",
            "Int64 -> Nope",
        ] {
            assert!(parse_signature(bad).is_err(), "{bad}");
        }
    }
}
