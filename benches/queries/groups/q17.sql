-- A median of a quantity of 100 values per group of a 10^3-value key.
SELECT k1k, median(q) AS med, count(*) AS n, max(v) AS hi
FROM facts
GROUP BY k1k
ORDER BY k1k
