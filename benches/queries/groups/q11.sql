-- A join on a 10^5-value key, the dimension filtered to about a tenth.
SELECT d.region, count(*) AS n, sum(f.v) AS s
FROM facts f JOIN dims d ON f.k100k = d.k100k
WHERE d.weight < 0.1
GROUP BY d.region
ORDER BY d.region
